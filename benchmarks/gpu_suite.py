"""The whole test suite on a GPU machine, serially: one command on the device.

The device machine (``device`` tool, docs/kernels.md "Running the GPU suite") has torch,
triton and transformers but none of the project's other dependencies, no network and a
64 MiB limit on what travels per call. So the work is split in two:

``python benchmarks/gpu_suite.py prepare`` (here, with network) downloads the wheels the
suite needs for the device's Python (3.12, x86-64) into ``.whl/`` and splits the SmolLM2
GGUF's xz stream (86 MiB, over one call's limit) into ``.model/`` parts of at most
``--part-mib`` MiB; both folders are git-ignored and travel with ``carry``.

``python3 benchmarks/gpu_suite.py run [PYTEST ARGS]`` (on the device) installs ``.whl/*.whl``
into ``/tmp/site`` (put on ``PYTHONPATH`` for the tests' subprocesses too), stages the model
parts it finds into the model cache and assembles the GGUF once every part has arrived
(checked against the manifest's SHA-256; a part brought by an earlier call on the same warm
machine stays staged), checks that every module the suite imports is present, then runs
``pytest`` serially (parallel workers on one GPU make the large kernel tests fail for
memory) and writes the log and a JUnit XML under ``$OUT`` (or ``--out``). With ``--workers N``
the tests not marked ``gpu`` run first in N pytest-xdist workers (the device has 16 cores; the
serial suite takes longer than one 10-minute call), then the ``gpu``-marked ones serially; with
``--gpu-workers M`` the ``gpu``-marked ones run in M workers too, except the full-size modules
(``SERIAL_GPU_MODULES``), which follow alone on the card.

The whole suite in two device calls (the wheels are ~23 MiB, the model three parts of 32 MiB
or less, the working tree ~5 MiB, and one call carries at most 64 MiB; the second call must
follow within 30 s, while the machine the first left is warm)::

    run(carry=[".whl", ".model/part-0", ".model/manifest.json"],
        command="python3 benchmarks/gpu_suite.py run --deadline 500 --workers 14 --no-gpu-marked --done done tests")
    # copy the XML it brought back into done/, then at once:
    run(carry=[".model/part-1", ".model/part-2", ".model/manifest.json"],
        command="python3 benchmarks/gpu_suite.py run --deadline 500 --workers 14 --gpu-workers 6 --done done tests")

The first runs the tests not marked ``gpu`` (the SmolLM2 ones skip: the model is not complete
yet, and ``DEEPWELL_OFFLINE=1`` keeps them from trying PyPI); the second, once the model is, the
SmolLM2 tests the first skipped and the ``gpu``-marked tests (``--done`` leaves out what passed
before; a skip does not count as done).
A call stopped at its limit, or a session without device time, is resumed at the same commit
with ``--done DIR``: the JUnit XML files earlier calls brought back, copied into the checkout
(e.g. ``done/``, which travels as an untracked file), and the tests that passed there are left out.
``--deadline S`` (below the call's limit) interrupts pytest in time for it to write that XML.
Each XML records the source tree's digest (``tree_digest``; ``gpu_suite.py tree`` prints it here),
and ``--same-tree`` counts only XML of the tree being run: calls resumed that way add up to one
pass of one commit.

The not-``gpu`` tests take ~5 minutes in 12 workers on an H100 host. The ~300 ``gpu``-marked ones
take about 18 minutes serially (an H200: 144 in 540 s); in six workers an H100 ran 266 in ~350 s
(``run --gpu-workers 6``, the full-size modules then alone), or they run as three serial calls on
the warm machine, ``run -m gpu --shard K/3 tests`` for K = 0, 1, 2 (every third test from the
K-th: the slow ones of a module spread over the calls). The log has a line per test and each failure's
traceback as it happens, so a call stopped at its limit still says what failed.

Without the GGUF the SmolLM2 tests skip (they say so); everything else still runs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
PARTS = ROOT / ".model"
SITE = Path("/tmp/site")

# what the suite imports beyond the device image (torch, triton, transformers, numpy, safetensors,
# tokenizers, jinja2, pytest); pinned where the CPU side pins them
DEVICE_WHEELS = [
    "structlog==26.1.0", "gguf==0.19.0", "grpcio==1.85.4", "grpcio-health-checking==1.81.1",
    "grpcio-reflection==1.81.1", "grpcio-tools==1.78.0", "protobuf==6.33.6", "prometheus-client",
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.55.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "annotated-doc==0.0.7", "typing-inspection==0.4.5", "typing-extensions==4.16.0",
    "anyio==4.16.0", "h11", "httpx", "httpcore", "sniffio", "idna", "certifi", "openai", "anthropic",
    # openai 3.x and anthropic 2.x import httpx2 (not httpx); httpx2 needs httpcore2 and truststore,
    # anthropic opentelemetry-api
    "httpx2==2.17.0", "httpcore2==2.17.0", "truststore==0.10.5", "opentelemetry-api==1.45.3",
    "distro", "jiter", "docstring-parser", "pytest-asyncio", "pytest-timeout", "hypothesis", "sortedcontainers",
    "attrs", "pyyaml", "fla-core", "pytest-xdist", "execnet",
]
# module -> distribution, checked on the device before pytest starts
REQUIRED_MODULES = {
    "structlog": "structlog", "gguf": "gguf", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection", "grpc_tools": "grpcio-tools", "google.protobuf": "protobuf",
    "prometheus_client": "prometheus-client", "fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic",
    "httpx": "httpx", "httpx2": "httpx2", "httpcore2": "httpcore2", "truststore": "truststore",
    "opentelemetry": "opentelemetry-api", "openai": "openai", "anthropic": "anthropic",
    "pytest_asyncio": "pytest-asyncio",
    "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis", "yaml": "pyyaml", "fla": "fla-core",
    "torch": "torch", "triton": "triton", "transformers": "transformers",
}
# gpu-marked modules that need the card to themselves: full-size contexts and workspaces (the
# Gluon decode's 128k cases ran out of memory beside five workers on an H100), or a pool sized
# from the free memory
SERIAL_GPU_MODULES = ["tests/kernels/test_gpu_large.py", "tests/kernels/test_gluon_decode.py",
                      "tests/kernels/test_dequant.py", "tests/engine/test_pool_sizing.py"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- here
# what the tests run: a change to any of these files makes another tree (docs, .model/, done/ do not)
TREE_DIRS = ("benchmarks", "deepwell", "engine_service", "gateway", "kernels", "kvcache_daemon", "protos", "tests")
TREE_FILES = ("pyproject.toml", "setup.py")
TREE_SUFFIXES = {".py", ".pyi", ".proto", ".jinja", ".json", ".toml"}


def tree_digest(root: Path = ROOT) -> str:
    """A digest of the source the suite runs (``TREE_DIRS``' code and data files, ``TREE_FILES``):
    the device's copy of the checkout has no ``.git``, so this stands for the commit. ``run``
    records it in each JUnit XML; ``--same-tree`` resumes only from XML of the same tree."""
    h = hashlib.sha256()
    files = [root / f for f in TREE_FILES if (root / f).is_file()]
    for d in TREE_DIRS:
        files += [f for f in (root / d).rglob("*") if f.suffix in TREE_SUFFIXES and f.is_file()
                  and not any(part == "__pycache__" or part.startswith(".") for part in f.relative_to(root).parts)]
    for f in sorted(files):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def split(file: Path, dest: Path, part_bytes: int, compress: str = "xz") -> int:
    """``file`` as ``dest/part-N`` of at most ``part_bytes`` and ``dest/manifest.json``; returns N parts.
    ``compress`` "xz": the parts are slices of the file's xz stream (the SmolLM2 GGUF: 93.8 -> 86.3
    MiB, so it and the wheels travel in two calls), "none": of the file itself."""
    if compress not in ("xz", "none"):
        raise ValueError(f"compress must be 'xz' or 'none', not {compress!r}")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("part-*"):
        old.unlink()
    data = file.read_bytes()
    import lzma  # here and in stage_model: a Python built without it still runs the rest

    packed = lzma.compress(data, format=lzma.FORMAT_XZ, preset=6) if compress == "xz" else data
    parts = []
    for start in range(0, len(packed), part_bytes):
        chunk = packed[start:start + part_bytes]
        p = dest / f"part-{len(parts)}"
        p.write_bytes(chunk)
        parts.append({"name": p.name, "sha256": hashlib.sha256(chunk).hexdigest(), "bytes": len(chunk)})
    manifest = {"file": file.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "compression": compress, "parts": parts}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return len(parts)


def prepare(args: argparse.Namespace) -> int:
    WHEELS.mkdir(exist_ok=True)
    missing = []
    for req in DEVICE_WHEELS:
        name = req.split("==")[0]
        have = [w for w in WHEELS.glob("*.whl") if w.name.lower().startswith(name.replace("-", "_").lower() + "-")]
        if have:
            continue
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d",
               str(WHEELS), req]
        if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
            missing.append(req)
    if missing:
        print(f"could not download: {', '.join(missing)}", file=sys.stderr)
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl"))
    print(f".whl: {len(list(WHEELS.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")

    sys.path.append(str(ROOT))
    from deepwell.engine_service.default_model import GGUF_NAME, ensure_default_model

    gguf = ensure_default_model()
    parts = split(gguf, PARTS, args.part_mib << 20, args.compress)
    print(f".model: {GGUF_NAME} in {parts} parts of <= {args.part_mib} MiB ({args.compress}; carry "
          ".model/manifest.json with every part)")
    return 1 if missing else 0


# ----------------------------------------------------------------------------- device
def install_wheels() -> None:
    wheels = sorted(WHEELS.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)], check=True)
    elif not SITE.is_dir():
        return
    # without .whl in this call, the wheels an earlier call on the same warm machine installed serve
    # the engine, daemon and gateway the tests start are subprocesses: they need the path too
    # (and the checkout, so `deepwell` imports in subprocesses started from any directory: nothing
    # is pip-installed there; deepwell._CheckoutFinder maps deepwell.engine_service etc. onto it)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", ""), str(ROOT))
                                               if p)
    sys.path.insert(0, str(SITE))
    importlib.invalidate_caches()


def stage_model(parts_dir: Path = PARTS, cache: Path | None = None) -> str:
    """Copy the parts that arrived into the cache; assemble the GGUF once all are there."""
    cache = cache or Path(os.environ.get("DEEPWELL_MODEL_CACHE") or Path.home() / ".cache" / "deepwell" / "models")
    staged = cache / "parts"
    staged.mkdir(parents=True, exist_ok=True)
    for p in parts_dir.glob("part-*"):
        shutil.copyfile(p, staged / p.name)
    if (parts_dir / "manifest.json").exists():
        shutil.copyfile(parts_dir / "manifest.json", staged / "manifest.json")
    if not (staged / "manifest.json").exists():
        return "no model manifest: SmolLM2 tests will skip"
    manifest = json.loads((staged / "manifest.json").read_text())
    target = cache / manifest["file"]
    if target.exists() and target.stat().st_size == manifest["bytes"]:
        return f"model ready: {target}"
    have = [part for part in manifest["parts"] if (staged / part["name"]).exists()]
    if len(have) < len(manifest["parts"]):
        names = [p["name"] for p in manifest["parts"] if p not in have]
        return f"model parts staged: {len(have)}/{len(manifest['parts'])} (still to carry: {', '.join(names)})"
    partial = target.with_suffix(".partial")
    unpack = None
    if manifest.get("compression") == "xz":
        try:
            import lzma
        except ImportError:
            return ("this Python has no lzma module: run `gpu_suite.py prepare --compress none` and carry "
                    "the parts again")
        unpack = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    with partial.open("wb") as out:
        for part in manifest["parts"]:
            data = (staged / part["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                out.close()
                partial.unlink()
                return f"model part {part['name']} is corrupt: carry it again"
            out.write(unpack.decompress(data) if unpack else data)
    if sha256(partial) != manifest["sha256"]:
        partial.unlink()
        return "assembled model does not match its SHA-256: prepare again"
    partial.rename(target)
    return f"model assembled: {target}"


def _pytest(out: Path, name: str, pytest_args: list[str], shard: str = "", deadline: float | None = None) -> int:
    """One pytest run, its output echoed and written to ``out/<name>.log`` (JUnit: ``<name>.xml``):
    a line per test as it ends and each failure's traceback when it happens
    (``DEEPWELL_REPORT_EARLY``, tests/conftest.py), so a run stopped at the call's time limit
    still names what failed and why; ``shard`` "K/N": every N-th test from the K-th.

    ``deadline`` (``time.monotonic()``): pytest is interrupted then (SIGINT, as Ctrl-C), so it
    still writes the JUnit XML of what finished (``--done`` resumes from it); killed if it has
    not stopped ``INTERRUPT_GRACE_S`` later. Past the deadline nothing runs (exit 124)."""
    if deadline is not None and deadline - time.monotonic() < 5:
        print(f"{name}: not started, the --deadline has passed", flush=True)
        return 124
    env = dict(os.environ, PYTHONUNBUFFERED="1", DEEPWELL_REPORT_EARLY="1")
    # no network here: a test needing the SmolLM2 GGUF before all its parts arrived skips at once
    # (tests/engine/fixtures_smollm2.py), instead of failing after pip's retries
    env.setdefault("DEEPWELL_OFFLINE", "1")
    if shard:
        env["DEEPWELL_TEST_SHARD"] = shard
        name = f"{name}-{shard.replace('/', 'of')}"
    args = ["-p", "no:cacheprovider", "-v", "-rfEs", "--durations=25", f"--junitxml={out / (name + '.xml')}",
            *pytest_args]
    print(" ".join([sys.executable, "-m", "pytest", *args]), flush=True)
    # pytest with Ctrl-C's handler even where SIGINT came ignored (a job started in the background
    # of a non-interactive shell, under nohup), so the --deadline's SIGINT stops it cleanly
    cmd = [sys.executable, "-c", _PYTEST_WITH_SIGINT, *args]
    # line-buffered: a run killed at the call's time limit still leaves every line it printed
    with (out / f"{name}.log").open("w", buffering=1) as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        timers = []
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            timers = [threading.Timer(left, _stop, (proc, signal.SIGINT, name)),
                      threading.Timer(left + INTERRUPT_GRACE_S, _stop, (proc, signal.SIGKILL, name))]
            for t in timers:
                t.daemon = True
                t.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                log.flush()
            rc = proc.wait()
        finally:
            for t in timers:
                t.cancel()
        return 124 if deadline is not None and time.monotonic() >= deadline and rc != 0 else rc


_PYTEST_WITH_SIGINT = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "sys.exit(pytest.console_main())")
INTERRUPT_GRACE_S = 45.0  # an interrupted pytest's time to finish its test's teardown and write the XML


def _stop(proc: subprocess.Popen[str], sig: int, name: str) -> None:
    if proc.poll() is None:
        print(f"{name}: --deadline reached, sending {signal.Signals(sig).name}", flush=True)
        proc.send_signal(sig)


def _valid_shard(spec: str) -> bool:
    k, _, n = spec.partition("/")
    return k.isdigit() and n.isdigit() and int(k) < int(n)


def run(args: argparse.Namespace, pytest_args: list[str]) -> int:
    install_wheels()
    print(stage_model(), flush=True)
    if args.stage_only:
        return 0
    absent = sorted({dist for mod, dist in REQUIRED_MODULES.items() if importlib.util.find_spec(mod) is None})
    if absent:
        print(f"missing on this machine: {', '.join(absent)} (run `python benchmarks/gpu_suite.py prepare` "
              "where pip works, and carry .whl)", file=sys.stderr)
        if not args.allow_missing:
            return 2
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    tree = tree_digest()
    os.environ["DEEPWELL_TEST_TREE"] = tree  # recorded in the JUnit XML (tests/conftest.py)
    print(f"source tree {tree}", flush=True)
    if args.done:
        files = done_files(args.done)
        os.environ["DEEPWELL_TEST_DONE"] = os.pathsep.join(map(str, files))  # tests/conftest.py: _Done
        if args.same_tree:
            os.environ["DEEPWELL_TEST_DONE_TREE"] = tree
        for f in files:
            was = xml_tree(f)
            counted = not args.same_tree or was == tree
            print(f"  {f}: tree {was or 'unrecorded'}{' (this one)' if was == tree else ''}"
                  f"{'' if counted else ': not counted (--same-tree)'}", flush=True)
        print(f"leaving out what passed in {len(files)} earlier JUnit XML file(s)", flush=True)
    tests = pytest_args or ["tests"]
    deadline = time.monotonic() + args.deadline if args.deadline else None
    if not args.workers and not args.gpu_workers:
        return _pytest(out, "gpu_suite", tests, args.shard, deadline)
    rcs: dict[str, int] = {}
    if args.workers:
        # the tests not marked gpu in parallel workers (small models, little GPU memory each)
        rcs[f"not gpu-marked (-n {args.workers})"] = _pytest(
            out, "gpu_suite_not_gpu", ["-n", str(args.workers), "-m", "not gpu", *tests], args.shard, deadline)
    if args.no_gpu_marked:
        pass  # only the tests not marked gpu (a call of its own; the gpu-marked ones in later calls)
    elif args.gpu_workers:
        # the gpu-marked ones that fit beside each other in parallel workers (most of the time is
        # compiling, which is CPU work), then the full-size ones alone on the card
        deselect = [f"--deselect={m}" for m in SERIAL_GPU_MODULES]
        rcs[f"gpu-marked (-n {args.gpu_workers})"] = _pytest(
            out, "gpu_suite_gpu_parallel", ["-n", str(args.gpu_workers), "-m", "gpu", *deselect, *tests], args.shard, deadline)
        serial = _serial_modules(tests)
        if serial:
            rcs["gpu-marked, full size (serial)"] = _pytest(
                out, "gpu_suite_gpu_serial", ["-m", "gpu", *_options(tests), *serial], args.shard, deadline)
    else:
        # serially: the large kernels fail for memory when many workers share the card
        rcs["gpu-marked (serial)"] = _pytest(out, "gpu_suite_gpu", ["-m", "gpu", *tests], args.shard, deadline)
    print("; ".join(f"{k}: exit {v}" for k, v in rcs.items()), flush=True)
    # 5: a phase that selected nothing (e.g. only full-size modules requested)
    return next((v for v in rcs.values() if v not in (0, 5)), 0)


def _options(tests: list[str]) -> list[str]:
    """The pytest arguments that are not test paths (``--deselect=...``, ``-k EXPR``): they apply
    to the serial phase too."""
    return [a for a in tests if not (ROOT / a.split("::")[0]).exists()]


def xml_tree(path: Path) -> str:
    """The source tree a JUnit XML file was written at (its ``deepwell_tree`` property), or ''."""
    import xml.etree.ElementTree as ET

    for prop in ET.parse(path).iter("property"):
        if prop.get("name") == "deepwell_tree":
            return prop.get("value", "")
    return ""


def done_files(paths: list[str]) -> list[Path]:
    """``--done``: JUnit XML files, a folder standing for every ``*.xml`` under it."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.xml"))
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"--done {p}: no such file or folder")
    return files


def _serial_modules(tests: list[str]) -> list[str]:
    """What the serial phase runs of the requested test paths: the full-size GPU modules under a
    folder, a full-size module named, or a test named in one."""
    options = _options(tests)
    out: list[str] = []
    for p in (t for t in tests if t not in options):
        f = p.split("::")[0].rstrip("/")
        out += [p] if f in SERIAL_GPU_MODULES else [m for m in SERIAL_GPU_MODULES if m.startswith(f + "/")]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: download the device wheels into .whl/ and split the GGUF into .model/")
    p.add_argument("--part-mib", type=int, default=32, help="size of one model part (default 32 MiB)")
    p.add_argument("--compress", choices=["xz", "none"], default="xz",
                   help="the parts are slices of the GGUF's xz stream (default) or of the GGUF itself")
    r = sub.add_parser("run", help="on the device: install .whl/, stage the model, run pytest serially")
    r.add_argument("--stage-only", action="store_true", help="install and stage the model parts, run no tests")
    r.add_argument("--out", help="where the log and JUnit XML go (default $OUT)")
    r.add_argument("--allow-missing", action="store_true", help="run even if a needed package is absent")
    r.add_argument("--workers", type=int, default=0, help="run the tests not marked gpu in this many pytest-xdist "
                   "workers first, then the gpu-marked ones serially (0 = everything serially)")
    r.add_argument("--gpu-workers", type=int, default=0,
                   help="run the gpu-marked tests in this many workers too, except the full-size modules "
                        "(SERIAL_GPU_MODULES), which follow serially; with --gpu-workers and no --workers the "
                        "tests not marked gpu do not run")
    r.add_argument("--no-gpu-marked", action="store_true",
                   help="with --workers: run only the tests not marked gpu (the gpu-marked ones in another call)")
    r.add_argument("--shard", default="", metavar="K/N",
                   help="run every N-th test from the K-th (0 <= K < N), counted after -m / -k: a suite longer "
                        "than one call as N calls")
    r.add_argument("--deadline", type=float, default=0.0, metavar="SECONDS",
                   help="stop pytest this long after the start (SIGINT: the JUnit XML of what finished is "
                        "still written, for --done); set it below the call's time limit, e.g. 540 for 600")
    r.add_argument("--done", action="append", default=[], metavar="XML",
                   help="leave out the tests that passed in this JUnit XML file (or every *.xml under this "
                        "folder; repeatable) of earlier calls at the same commit: a suite spread over calls or "
                        "sessions goes on where it stopped (copy the files a call brought back into the checkout)")
    r.add_argument("--same-tree", action="store_true",
                   help="with --done: count only the XML written at this same source tree (tree_digest), so "
                        "the calls add up to one pass of one commit")
    sub.add_parser("tree", help="print the source tree's digest, as run records it in the JUnit XML")
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "run" and args.shard and not _valid_shard(args.shard):
        ap.error(f"--shard {args.shard!r} must be K/N with 0 <= K < N")
    if args.cmd == "run" and args.no_gpu_marked and not args.workers:
        ap.error("--no-gpu-marked runs the tests not marked gpu in --workers N workers: give --workers")
    if args.cmd == "tree":
        print(tree_digest())
        return 0
    if args.cmd == "prepare":
        if rest:
            ap.error(f"unexpected arguments: {rest}")
        return prepare(args)
    return run(args, [a for a in rest if a != "--"])


if __name__ == "__main__":
    sys.exit(main())
