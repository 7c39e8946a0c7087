"""The shared arena file: created mode 0600 after a free-space check, prefaulted, mmap'd.

Contract: the file is never truncated while mapped. The daemon holds an exclusive
``flock`` on it while it runs, so a second daemon on the same path refuses to start
(instead of reusing a live arena or stealing its socket). A file left behind by a SIGKILLed
daemon is reused when it has the configured size and is ours (regular file, our uid,
mode 0600); otherwise it is unlinked (mappings of old clients stay valid) and a fresh one
is created. ``keep_contents`` (persistence) reuses the bytes as they are; without it the
bytes are left unspecified (the index starts empty, so nothing old can ever match).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from dataclasses import dataclass

from deepwell import logs

log = logs.get_logger(__name__)
PAGE = 4096


class ArenaError(RuntimeError):
    """The arena cannot be created or opened (no space, wrong owner, bad path)."""


@dataclass
class Arena:
    path: str
    size: int
    fd: int
    map: mmap.mmap
    reused: bool

    def view(self) -> memoryview:
        return memoryview(self.map)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a memoryview still exported: the OS unmaps at exit
            pass
        os.close(self.fd)


def _usable(path: str, size: int) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o600
            and st.st_size == size)


def _lock(fd: int, path: str) -> None:
    """Exclusive advisory lock for the daemon's lifetime (the kernel drops it on SIGKILL)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ArenaError(f"arena {path} is in use by another running daemon") from None


def open_arena(path: str, size: int, *, keep_contents: bool, prefault: bool = True) -> Arena:
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise ArenaError(f"arena directory {directory!r} does not exist")
    old_fd = None
    if os.path.lexists(path):
        try:
            old_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            old_fd = None
        if old_fd is not None:
            _lock(old_fd, path)  # a live daemon holds it: refuse rather than steal
    reused = old_fd is not None and _usable(path, size)
    if not reused:
        if old_fd is not None:
            os.close(old_fd)
        if keep_contents and os.path.exists(path):
            log.warning("arena_discarded", path=path, reason="size, owner or mode differs")
        if os.path.lexists(path):
            os.unlink(path)
        vfs = os.statvfs(directory)
        free = vfs.f_bavail * vfs.f_frsize
        if free < size:
            raise ArenaError(f"arena needs {size} bytes but {directory} has only {free} free")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        _lock(fd, path)
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)  # reserves the pages now: ENOSPC here, never SIGBUS later
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise ArenaError(f"cannot allocate {size} bytes for the arena at {path}: {exc}") from exc
    else:
        assert old_fd is not None
        fd = old_fd
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if prefault:
        _prefault(m, size)
    log.info("arena_ready", path=path, size=size, reused=reused)
    return Arena(path, size, fd, m, reused)


def _prefault(m: mmap.mmap, size: int) -> None:
    """Touch every page (read) so first use never page-faults."""
    import numpy as np

    if hasattr(mmap, "MADV_WILLNEED"):
        m.madvise(mmap.MADV_WILLNEED)
    step = 64 * 1024 * 1024
    view = np.frombuffer(m, dtype=np.uint8)
    for off in range(0, size, step):
        int(view[off:off + step:PAGE].sum())
    del view
