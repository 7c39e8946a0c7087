"""Shared pytest setup: the ``gpu`` and ``slow`` markers skip unless their resources exist."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _import_installed_kernels() -> None:
    """pytest puts the checkout's root on ``sys.path`` (the tests import ``tests.*``), where
    deepwell's ``kernels/`` folder would shadow Hugging Face's top-level ``kernels`` package
    (transformers >= 5.25 imports it). deepwell itself imports only ``deepwell.kernels``, so
    import the installed ``kernels`` first, from the path without the checkout, when there is one."""
    root = Path(__file__).resolve().parents[1]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != root]
    try:
        import kernels  # noqa: F401 - cached in sys.modules for transformers
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


_import_installed_kernels()

# gRPC's fork handlers restart its poller in a forked child, and Popen(close_fds=True) then
# closes that poller's epoll descriptor before exec: the child aborts now and then
# ("epoll_wait error: Bad file descriptor", grpc/grpc#43055, grpcio >= 1.81). The tests fork only
# to exec a process (``preexec_fn`` sets its parent-death signal), so the handlers stay off. Set
# before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Triton kernels run through the interpreter where there is no GPU. Set before anything
# imports triton (its @jit reads the variable when a kernel is defined).
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = os.environ.get("DEEPWELL_SLOW") == "1"
    has_gpu = _cuda_available()
    skip_slow = pytest.mark.skip(reason="slow test: set DEEPWELL_SLOW=1 to run")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


SHARD_ENV = "DEEPWELL_TEST_SHARD"  # "K/N": run every N-th test from the K-th (benchmarks/gpu_suite.py --shard)
DONE_ENV = "DEEPWELL_TEST_DONE"  # JUnit XML files (os.pathsep): leave out what passed there (gpu_suite.py --done)
TREE_ENV = "DEEPWELL_TEST_TREE"  # the source tree's digest, recorded in the JUnit XML (gpu_suite.py tree_digest)
DONE_TREE_ENV = "DEEPWELL_TEST_DONE_TREE"  # with DONE_ENV: count only XML recorded at this tree (--same-tree)
EARLY_ENV = "DEEPWELL_REPORT_EARLY"  # "1": print each failure's traceback when it happens


def _shard(spec: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"{SHARD_ENV}={spec!r} must be K/N with 0 <= K < N") from None
    if not 0 <= k < n:
        raise pytest.UsageError(f"{SHARD_ENV}={spec!r} must be K/N with 0 <= K < N")
    return k, n


class _Shard:
    """Keeps the tests whose index (after -m / -k) is K modulo N: a suite too long for one device
    call runs as N calls, the slow tests of a module spread over them."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n = k, n

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep = [it for i, it in enumerate(items) if i % self.n == self.k]
        drop = [it for i, it in enumerate(items) if i % self.n != self.k]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep


def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) of a test's node id as pytest's JUnit XML writes them."""
    from _pytest.junitxml import mangle_test_address  # the junitxml plugin's own mapping

    names = mangle_test_address(nodeid)
    return ".".join(names[:-1]), names[-1]


def passed_in(xml_files: list[str], tree: str = "") -> set[tuple[str, str]]:
    """The tests with no failure, error or skip in these JUnit XML files (with ``tree``: only
    in the files recorded at that source tree)."""
    import xml.etree.ElementTree as ET

    done = set()
    for f in xml_files:
        root = ET.parse(f)
        if tree and not any(p.get("name") == "deepwell_tree" and p.get("value") == tree for p in root.iter("property")):
            continue
        for case in root.iter("testcase"):
            if not any(child.tag in ("failure", "error", "skipped") for child in case):
                done.add((case.get("classname", ""), case.get("name", "")))
    return done


class _Done:
    """Leaves out the tests that passed in earlier runs' JUnit XML (of the same commit): a suite
    spread over device calls, or over sessions, goes on where it stopped."""

    def __init__(self, done: set[tuple[str, str]]) -> None:
        self.done = done

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep: list[pytest.Item] = []
        drop: list[pytest.Item] = []
        for it in items:
            (drop if junit_key(it.nodeid) in self.done else keep).append(it)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


class _EarlyReport:
    """Each failure's traceback on the terminal when it happens (a device call killed at its time
    limit never reaches pytest's summary)."""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            sys.stdout.write(f"\n{'=' * 20} {report.when} FAILED: {report.nodeid}\n{report.longreprtext}\n"
                             f"{report.capstdout[-4000:]}\n")
            sys.stdout.flush()


def pytest_sessionstart(session: pytest.Session) -> None:
    """``DEEPWELL_TEST_TREE``: the JUnit XML says which source tree it ran (``--same-tree``)."""
    tree = os.environ.get(TREE_ENV)
    if tree:
        from _pytest.junitxml import xml_key

        log_xml = session.config.stash.get(xml_key, None)  # None: no --junitxml, or an xdist worker
        if log_xml is not None:
            log_xml.add_global_property("deepwell_tree", tree)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(DONE_ENV):
        files = [f for f in os.environ[DONE_ENV].split(os.pathsep) if f]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise pytest.UsageError(f"{DONE_ENV}: no such JUnit XML file: {', '.join(missing)}")
        config.pluginmanager.register(_Done(passed_in(files, os.environ.get(DONE_TREE_ENV, ""))), "deepwell-done")
    if os.environ.get(SHARD_ENV):
        config.pluginmanager.register(_Shard(*_shard(os.environ[SHARD_ENV])), "deepwell-shard")
    if os.environ.get(EARLY_ENV) == "1":
        config.pluginmanager.register(_EarlyReport(), "deepwell-early-report")
    # Two cores are shared by the test process and the servers it starts; torch's intra-op
    # threads oversubscribe them (tiny-model steps got ~20x slower with 2 threads under load).
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a module's last test (its module fixtures are gone by then): collect garbage and
    hand the C heap's free memory back to the system. A test process that keeps a large heap
    makes every server process it starts later markedly slower on the CI VM."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        import ctypes
        import gc

        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
