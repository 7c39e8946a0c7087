"""Client-side arena mapping and byte copies into/out of an extent list (no torch).

An entry's *logical* bytes are the concatenation of its extents in order; ``copy_in`` and
``copy_out`` address that logical space. The mapping stays valid even if the daemon dies
or unlinks the file (the kernel keeps the pages while mapped), so a copy in flight always
completes with intact bytes; whether the bytes may be *used* is decided by the daemon's
answer to Release/Commit afterwards.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Sequence
from typing import Any

Extent = tuple[int, int]  # (offset, length)


def as_extents(extents: Iterable[Any]) -> list[Extent]:
    """Accept (offset, length) tuples or protobuf ``Extent`` messages."""
    out = []
    for e in extents:
        out.append((int(e.offset), int(e.length)) if hasattr(e, "offset") else (int(e[0]), int(e[1])))
    return out


class ArenaMap:
    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                raise ValueError(f"arena {path} is {st.st_size} bytes, daemon says {size}")
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.inode = (st.st_dev, st.st_ino)
        self.view = memoryview(self.map)

    def same_file(self, path: str, size: int) -> bool:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return path == self.path and size == self.size and (st.st_dev, st.st_ino) == self.inode

    def _pieces(self, extents: Sequence[Any], start: int, length: int) -> Iterable[tuple[int, int, int]]:
        """(arena offset, logical position, length) pieces covering [start, start+length)."""
        pos = 0
        end = start + length
        for off, ln in as_extents(extents):
            if off < 0 or off + ln > self.size:
                raise ValueError(f"extent ({off}, {ln}) lies outside the arena of {self.size} bytes")
            lo, hi = max(start, pos), min(end, pos + ln)
            if lo < hi:
                yield off + (lo - pos), lo - start, hi - lo
            pos += ln
            if pos >= end:
                return
        if pos < end:
            raise ValueError(f"extents hold {pos} bytes, need {end}")

    def copy_in(self, extents: Sequence[Any], src: Any, start: int = 0) -> int:
        """Write ``src`` (any bytes-like) at logical offset ``start`` of the extents."""
        mv = memoryview(src).cast("B")
        for off, pos, n in self._pieces(extents, start, len(mv)):
            self.view[off:off + n] = mv[pos:pos + n]
        return len(mv)

    def copy_out(self, extents: Sequence[Any], dst: Any, start: int = 0) -> int:
        """Fill the writable buffer ``dst`` from logical offset ``start`` of the extents."""
        mv = memoryview(dst).cast("B")
        for off, pos, n in self._pieces(extents, start, len(mv)):
            mv[pos:pos + n] = self.view[off:off + n]
        return len(mv)

    def read(self, extents: Sequence[Any], length: int, start: int = 0) -> bytes:
        buf = bytearray(length)
        self.copy_out(extents, buf, start)
        return bytes(buf)

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view: unmapped when collected
            pass
