"""Index journal: committed entries survive a daemon restart (with a file-backed arena).

Append-only file of records ``MAGIC | kind u8 | len u64 | payload | crc32(kind|payload)``
written with one unbuffered ``write`` each, after the state change they describe, so a
SIGKILLed daemon leaves at most one torn record at the tail. Replay stops at the first
record that is short or fails its CRC: everything after it is discarded. Only COMMIT,
REMOVE and MOVE are journaled: reservations, leases and takes belong to clients of the
old epoch and die with it (a taken entry is still committed in the journal). After replay
the journal is rewritten (temp file + rename) holding only the live entries and the new
epoch. Identity and Layout payloads are protobuf (never pickle); tokens are raw uint32 LE.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from deepwell import logs
from deepwell.kvcache.v1 import kvcache_pb2 as pb

from .allocator import Run
from .model import Entry

log = logs.get_logger(__name__)

MAGIC = b"DWJ1"
HEADER, COMMIT, REMOVE, MOVE = 1, 2, 3, 4
_HEAD = struct.Struct("<4sBQ")
_CRC = struct.Struct("<I")


@dataclass
class Recovered:
    id: int
    generation: int
    identity: pb.Identity
    layout: pb.Layout
    runs: list[Run]
    tokens: np.ndarray


def _record(kind: int, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(bytes([kind])))
    return _HEAD.pack(MAGIC, kind, len(payload)) + payload + _CRC.pack(crc)


def _runs_bytes(runs: list[Run]) -> bytes:
    return struct.pack("<I", len(runs)) + b"".join(struct.pack("<QQ", s, n) for s, n in runs)


def _read_runs(buf: memoryview, pos: int) -> tuple[list[Run], int]:
    (k,) = struct.unpack_from("<I", buf, pos)
    pos += 4
    runs = [struct.unpack_from("<QQ", buf, pos + 16 * i) for i in range(k)]
    return [(int(s), int(n)) for s, n in runs], pos + 16 * k


def _commit_payload(e: Entry) -> bytes:
    ident = e.identity.SerializeToString()
    lay = e.layout.SerializeToString()
    return b"".join([struct.pack("<QQI", e.id, e.generation, len(ident)), ident, struct.pack("<I", len(lay)), lay,
                     _runs_bytes(e.runs), np.ascontiguousarray(e.tokens, dtype="<u4").tobytes()])


def _records(data: bytes) -> Iterator[tuple[int, memoryview]]:
    view = memoryview(data)
    pos = 0
    while pos + _HEAD.size <= len(data):
        magic, kind, n = _HEAD.unpack_from(view, pos)
        end = pos + _HEAD.size + n
        if magic != MAGIC or end + _CRC.size > len(data):
            log.warning("journal_torn_tail", offset=pos, discarded=len(data) - pos)
            return
        payload = view[pos + _HEAD.size:end]
        (crc,) = _CRC.unpack_from(view, end)
        if crc != zlib.crc32(payload, zlib.crc32(bytes([kind]))):
            log.warning("journal_bad_crc", offset=pos, discarded=len(data) - pos)
            return
        yield kind, payload
        pos = end + _CRC.size
    if pos != len(data):
        log.warning("journal_torn_tail", offset=pos, discarded=len(data) - pos)


def replay(path: str, arena_bytes: int, granule_bytes: int) -> list[Recovered]:
    """Live committed entries recorded in ``path`` (empty when missing or for another arena)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    live: dict[int, Recovered] = {}
    first = True
    for kind, p in _records(data):
        if first:
            first = False
            if kind != HEADER or struct.unpack_from("<QQ", p, 0) != (arena_bytes, granule_bytes):
                log.warning("journal_mismatch", path=path, reason="arena size or granule differs")
                return []
            continue
        if kind == COMMIT:
            eid, gen, n = struct.unpack_from("<QQI", p, 0)
            pos = 20
            ident = pb.Identity.FromString(bytes(p[pos:pos + n]))
            pos += n
            (m,) = struct.unpack_from("<I", p, pos)
            lay = pb.Layout.FromString(bytes(p[pos + 4:pos + 4 + m]))
            runs, pos = _read_runs(p, pos + 4 + m)
            tokens = np.frombuffer(bytes(p[pos:]), dtype="<u4").astype(np.uint32)
            live[eid] = Recovered(eid, gen, ident, lay, runs, tokens)
        elif kind == REMOVE:
            (eid,) = struct.unpack_from("<Q", p, 0)
            live.pop(eid, None)
        elif kind == MOVE:
            eid, gen = struct.unpack_from("<QQ", p, 0)
            runs, _ = _read_runs(p, 16)
            if eid in live:
                live[eid].generation, live[eid].runs = gen, runs
    return sorted(live.values(), key=lambda r: r.id)


class FileJournal:
    """Appends records; ``rewrite`` starts a fresh file holding the given entries."""

    def __init__(self, path: str, arena_bytes: int, granule_bytes: int) -> None:
        self.path = path
        self.arena_bytes = arena_bytes
        self.granule_bytes = granule_bytes
        self._f = None
        self.records = 0

    def rewrite(self, entries: list[Entry], epoch: int) -> None:
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_record(HEADER, struct.pack("<QQQ", self.arena_bytes, self.granule_bytes, epoch)))
            for e in entries:
                f.write(_record(COMMIT, _commit_payload(e)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if self._f is not None:
            self._f.close()
        self._f = open(self.path, "ab", buffering=0)
        self.records = len(entries)

    def _append(self, kind: int, payload: bytes) -> None:
        assert self._f is not None, "rewrite() must run before appending"
        self._f.write(_record(kind, payload))
        self.records += 1

    def commit(self, entry: Entry) -> None:
        self._append(COMMIT, _commit_payload(entry))

    def remove(self, entry_id: int) -> None:
        self._append(REMOVE, struct.pack("<Q", entry_id))

    def move(self, entry: Entry) -> None:
        self._append(MOVE, struct.pack("<QQ", entry.id, entry.generation) + _runs_bytes(entry.runs))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
