"""``benchmarks/gpu_suite.py``: the model split into parts that fit one device call, staged
over several calls and assembled only when every part has arrived intact."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks import gpu_suite


def test_parts_are_staged_across_calls_and_assembled_when_complete(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(10_000))
    parts = tmp_path / "parts"
    assert gpu_suite.split(model, parts, 3_000, compress="none") == 4
    manifest = json.loads((parts / "manifest.json").read_text())
    assert [p["bytes"] for p in manifest["parts"]] == [3000, 3000, 3000, 1000]

    cache = tmp_path / "cache"
    first, second = tmp_path / "call1", tmp_path / "call2"
    for d, names in ((first, ["part-0", "part-1"]), (second, ["part-2", "part-3", "manifest.json"])):
        d.mkdir()
        for n in names:
            (d / n).write_bytes((parts / n).read_bytes())
    assert "no model manifest" in gpu_suite.stage_model(first, cache)
    assert not (cache / "m.gguf").exists()
    (second / "part-3").unlink()  # the last part has not arrived yet
    assert "2/4" not in gpu_suite.stage_model(second, cache)  # 3 of 4 staged, the 4th still owed
    assert "part-3" in gpu_suite.stage_model(second, cache)
    (second / "part-3").write_bytes((parts / "part-3").read_bytes())
    assert "assembled" in gpu_suite.stage_model(second, cache)
    assert (cache / "m.gguf").read_bytes() == model.read_bytes()
    assert "ready" in gpu_suite.stage_model(second, cache)


def test_xz_parts_assemble_to_the_file(tmp_path: Path) -> None:
    """The default: the parts are slices of the file's xz stream (a GGUF's vocabulary and
    metadata compress), unpacked while they are assembled and checked against the file's hash."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"tokenizer.ggml.tokens " * 2_000 + os.urandom(4_000))
    parts = tmp_path / "parts"
    n = gpu_suite.split(model, parts, 2_000)
    manifest = json.loads((parts / "manifest.json").read_text())
    assert manifest["compression"] == "xz" and sum(p["bytes"] for p in manifest["parts"]) < model.stat().st_size
    assert n == len(manifest["parts"]) >= 2
    assert "assembled" in gpu_suite.stage_model(parts, tmp_path / "cache")
    assert (tmp_path / "cache" / "m.gguf").read_bytes() == model.read_bytes()


def test_a_corrupt_part_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(5_000))
    parts = tmp_path / "parts"
    gpu_suite.split(model, parts, 2_000)
    (parts / "part-1").write_bytes(b"x" * 2_000)
    assert "part-1 is corrupt" in gpu_suite.stage_model(parts, tmp_path / "cache")
    assert not (tmp_path / "cache" / "m.gguf").exists()


def _collected(env: dict[str, str], *args: str) -> list[str]:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=root, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    return [line for line in out.stdout.splitlines() if "::" in line] if out.returncode == 0 else [out.stdout + out.stderr]


def test_shards_split_the_tests_without_overlap() -> None:
    """``--shard K/N`` (tests/conftest.py, ``DEEPWELL_TEST_SHARD``): the N shards together are
    the suite, each test in exactly one, after -k has chosen; a bad spec is a usage error."""
    from types import SimpleNamespace

    import pytest

    from tests.conftest import _shard, _Shard

    items = [f"t{i}" for i in range(7)]
    shards, dropped = [], []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    for k in range(3):
        mine = list(items)
        _Shard(*_shard(f"{k}/3")).pytest_collection_modifyitems(config, mine)  # type: ignore[arg-type]
        shards.append(mine)
    assert sorted(sum(shards, [])) == items and sum(map(len, shards)) == len(items)
    assert len(dropped) == 2 * len(items)
    for bad in ("3/3", "x", "1"):
        with pytest.raises(pytest.UsageError, match="must be K/N"):
            _shard(bad)
    # and the environment variable reaches a real pytest run
    here = "tests/foundation/test_gpu_suite.py"
    tests = [n for n in globals() if n.startswith("test_")]
    second = _collected({"DEEPWELL_TEST_SHARD": "1/2"}, here)
    assert len(second) == len(tests) // 2 and all(t.startswith(here) for t in second), second


def test_run_refuses_a_bad_shard() -> None:
    import pytest

    for bad in ("3/3", "a/b", "1"):
        with pytest.raises(SystemExit):
            gpu_suite.main(["run", "--shard", bad, "--stage-only"])
    with pytest.raises(SystemExit):  # nothing would run
        gpu_suite.main(["run", "--no-gpu-marked", "--stage-only"])


def test_a_failure_is_reported_when_it_happens(capsys) -> None:
    """``DEEPWELL_REPORT_EARLY=1`` (set by ``gpu_suite run``): the traceback and captured output
    of a failing test reach the log at once, not only in the summary a killed run never prints."""
    from types import SimpleNamespace

    from tests.conftest import _EarlyReport

    plugin = _EarlyReport()
    plugin.pytest_runtest_logreport(SimpleNamespace(failed=False, when="call", nodeid="t::ok", longreprtext="",
                                                    capstdout=""))
    plugin.pytest_runtest_logreport(SimpleNamespace(failed=True, when="call", nodeid="t::bad",
                                                    longreprtext="AssertionError: 1 == 2", capstdout="kl 1.2e-02"))
    out = capsys.readouterr().out
    assert "t::ok" not in out
    assert "call FAILED: t::bad" in out and "AssertionError: 1 == 2" in out and "kl 1.2e-02" in out


def test_the_serial_phase_keeps_the_options() -> None:
    """``run --gpu-workers M --deselect=X tests``: the full-size modules' serial phase gets the
    options too (a deselected full-size module stays deselected), not the test paths."""
    args = ["-k", "not slow", "--deselect=tests/kernels/test_dequant.py", "tests", "tests/kernels/test_gpu_large.py"]
    assert gpu_suite._options(args) == ["-k", "not slow", "--deselect=tests/kernels/test_dequant.py"]
    assert "tests/kernels/test_gpu_large.py" in gpu_suite._serial_modules(args)
    assert gpu_suite._serial_modules(["tests/engine"]) == ["tests/engine/test_pool_sizing.py"]
    one = "tests/kernels/test_dequant.py::test_a_gpu_case"  # deselected from the parallel phase with its module
    assert gpu_suite._serial_modules([one, "tests/gateway"]) == [one]


def test_what_passed_in_a_real_junit_xml_is_left_out(tmp_path: Path) -> None:
    """A JUnit XML that pytest itself wrote names its tests as ``junit_key`` does: the tests
    that passed in it are left out of the next run, the rest stay."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    here = "tests/foundation/test_gpu_suite.py"
    xml = tmp_path / "earlier.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", here, "-k", "xz or corrupt",
                    f"--junitxml={xml}"], cwd=root, check=True, capture_output=True, timeout=120,
                   env={**os.environ, "DEEPWELL_TEST_TREE": "0123abcd"})
    left = {x.split("::")[1] for x in _collected({"DEEPWELL_TEST_DONE": str(xml)}, here)}
    ran = {"test_xz_parts_assemble_to_the_file", "test_a_corrupt_part_is_refused"}
    assert not left & ran and left == {n for n in globals() if n.startswith("test_")} - ran, left
    # the run recorded its source tree; --same-tree counts only XML of the tree it runs
    from tests.conftest import passed_in

    assert gpu_suite.xml_tree(xml) == "0123abcd"
    assert {k[1] for k in passed_in([str(xml)], "0123abcd")} == ran == {k[1] for k in passed_in([str(xml)])}
    other = _collected({"DEEPWELL_TEST_DONE": str(xml), "DEEPWELL_TEST_DONE_TREE": "ffff0000"}, here)
    assert ran <= {x.split("::")[1] for x in other}, other


def test_the_tree_digest_follows_the_code_not_the_rest(tmp_path: Path) -> None:
    """``tree_digest`` (what ``run`` records and ``--same-tree`` compares): the same files give
    the same digest; a changed, added or renamed source file another; docs, caches and files
    outside the source folders none."""
    import shutil

    root = tmp_path / "a"
    (root / "engine_service").mkdir(parents=True)
    (root / "tests" / "__pycache__").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "pyproject.toml").write_text("[project]\n")
    (root / "engine_service" / "x.py").write_text("A = 1\n")
    (root / "tests" / "test_x.py").write_text("def test(): pass\n")
    d = gpu_suite.tree_digest(root)
    assert len(d) == 16 and gpu_suite.tree_digest(shutil.copytree(root, tmp_path / "b")) == d
    (root / "docs" / "x.md").write_text("notes")
    (root / "tests" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / "done.xml").write_text("<testsuites/>")
    assert gpu_suite.tree_digest(root) == d
    (root / "engine_service" / "x.py").write_text("A = 2\n")
    assert gpu_suite.tree_digest(root) != d
    (root / "engine_service" / "x.py").write_text("A = 1\n")
    (root / "engine_service" / "x.py").rename(root / "engine_service" / "y.py")
    assert gpu_suite.tree_digest(root) != d


def test_done_leaves_out_what_passed_in_earlier_runs(tmp_path: Path) -> None:
    """``run --done XML`` (``DEEPWELL_TEST_DONE``): a test that passed there is left out; one
    that failed, errored or skipped there, or is not there, runs again."""
    import pytest

    here = "tests/foundation/test_gpu_suite.py"
    mod = "tests.foundation.test_gpu_suite"
    tests = sorted(n for n in globals() if n.startswith("test_"))
    passed, failed, skipped = tests[0], tests[1], tests[2]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "earlier.xml").write_text(
        f'<testsuites><testsuite name="pytest"><testcase classname="{mod}" name="{passed}" time="1"/>'
        f'<testcase classname="{mod}" name="{failed}"><failure message="x"/></testcase>'
        f'<testcase classname="{mod}" name="{skipped}"><skipped message="y"/></testcase>'
        f'<testcase classname="other.module" name="{tests[3]}"/></testsuite></testsuites>')
    files = gpu_suite.done_files([str(tmp_path)])
    assert files == [tmp_path / "a" / "earlier.xml"]
    left = _collected({"DEEPWELL_TEST_DONE": str(files[0])}, here)
    assert sorted(x.split("::")[1] for x in left) == [t for t in tests if t != passed], left
    assert "no such JUnit XML file" in _collected({"DEEPWELL_TEST_DONE": str(tmp_path / "none.xml")}, here)[0]
    with pytest.raises(SystemExit):
        gpu_suite.done_files([str(tmp_path / "none")])


def test_a_deadline_interrupts_pytest_and_keeps_the_junit_xml(tmp_path: Path) -> None:
    """``run --deadline S``: pytest is interrupted (SIGINT) at the deadline and still writes the
    JUnit XML of what finished, which ``--done`` then resumes from; past it nothing starts."""
    import time
    import xml.etree.ElementTree as ET

    mod = tmp_path / "test_slow_suite.py"
    mod.write_text("import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(300)\n")
    t0 = time.monotonic()
    rc = gpu_suite._pytest(tmp_path, "cut", [str(mod)], deadline=time.monotonic() + 8)
    assert rc == 124 and time.monotonic() - t0 < 8 + gpu_suite.INTERRUPT_GRACE_S
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "cut.xml").getroot().iter("testcase")}
    assert "test_quick" in cases and not list(cases["test_quick"])  # passed: no failure/skip child
    assert "test_slow" not in cases or list(cases["test_slow"])  # never recorded as passed
    assert gpu_suite._pytest(tmp_path, "late", [str(mod)], deadline=time.monotonic() + 1) == 124
    assert not (tmp_path / "late.log").exists()
