"""What a host cache entry must agree on to be reused: the model / layout fingerprint, and the
shape of the entry's bytes (its layout descriptor).

The *fingerprint* names everything that gives the bytes their meaning besides the tokens:
the model (id, a revision digest of its weight files, its text config), the dtype, the KV
format with its calibration digest (global scales, centering, rounding, rotations), the page
size, the byte sizes of a page and a state slot, and the tensor-parallel size (which orders
the bytes of a page row). Two engines with equal fingerprints
write interchangeable entries; any difference is a different fingerprint, so the daemon never
matches them (``kvcache.v1.Identity.model_fingerprint``).

An entry's bytes (``EntryShape``): ``pages`` KV pages row-major over every attention layer
(``kv.pool``), then, for hybrid models, the state image (one state-slot row: every layer's
conv then recurrent state). The layout descriptor is JSON naming the version and the sizes;
an entry whose descriptor disagrees with this engine's sizes is never restored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepwell.kvcache.v1 import kvcache_pb2 as pb

ENTRY_VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def revision(path: Path) -> str:
    """A digest of the weight files' names, sizes and modification times (cheap; changes
    whenever a weight file is rewritten)."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def model_fingerprint(*, model_id: str, revision: str, config: Mapping[str, Any], dtype: str, kv_format: str,
                      calibration_digest: str, page_size: int, page_nbytes: int, slot_nbytes: int,
                      tensor_parallel: int = 1) -> bytes:
    """32 bytes naming the model, its weights and its KV / state layout (see the module doc).
    ``tensor_parallel`` > 1: an entry's page rows are the ranks' rows side by side
    (``parallel.runner``), another byte order than one process writes (1 leaves it out)."""
    doc = {"v": ENTRY_VERSION, "model": model_id, "revision": revision, "dtype": dtype, "kv": kv_format,
           "calibration": calibration_digest, "page_size": page_size, "page_nbytes": page_nbytes,
           "slot_nbytes": slot_nbytes,
           "config": hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(),
                                     digest_size=16).hexdigest()}
    if tensor_parallel != 1:
        doc["tensor_parallel"] = tensor_parallel
    return hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=32, person=b"dw-model-fp").digest()


@dataclass(frozen=True)
class EntryShape:
    pages: int
    page_nbytes: int
    state_nbytes: int  # 0: no recurrent state

    @property
    def kv_nbytes(self) -> int:
        return self.pages * self.page_nbytes

    @property
    def total(self) -> int:
        return self.kv_nbytes + self.state_nbytes

    def layout(self) -> pb.Layout:
        parts = []
        if self.kv_nbytes:
            parts.append(pb.Part(name="kv", role=pb.PART_ROLE_ATTENTION_KV, offset=0, length=self.kv_nbytes))
        if self.state_nbytes:
            parts.append(pb.Part(name="state", role=pb.PART_ROLE_RECURRENT_STATE, offset=self.kv_nbytes,
                                 length=self.state_nbytes))
        desc = json.dumps({"v": ENTRY_VERSION, "pages": self.pages, "page_nbytes": self.page_nbytes,
                           "state_nbytes": self.state_nbytes}, sort_keys=True).encode()
        return pb.Layout(parts=parts, total_bytes=self.total, descriptor=desc)

    @property
    def part_names(self) -> list[str]:
        return [p.name for p in self.layout().parts]

    @classmethod
    def parse(cls, layout: pb.Layout, page_nbytes: int, state_nbytes: int) -> EntryShape | None:
        """The shape an entry's layout describes, or None when it is not one this engine can read."""
        try:
            d = json.loads(layout.descriptor)
            shape = cls(int(d["pages"]), int(d["page_nbytes"]), int(d["state_nbytes"]))
            ok = d.get("v") == ENTRY_VERSION
        except (ValueError, KeyError, TypeError):
            return None
        if not ok or shape.page_nbytes != page_nbytes or shape.state_nbytes != state_nbytes:
            return None
        if shape.layout() != layout:
            return None
        return shape
