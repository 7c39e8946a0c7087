"""Validation of client requests: a malformed one raises ``BadRequest`` (gRPC INVALID_ARGUMENT)
before any state changes. Domain conditions (a missing state part, budget) are not checked
here: they are typed ``Failure`` results of the core.
"""

from __future__ import annotations

import numpy as np

from deepwell.kvcache.v1 import kvcache_pb2 as pb

from .model import BadRequest


def validate_reserve(identity: pb.Identity, layout: pb.Layout, tokens: np.ndarray) -> None:
    if not identity.model_fingerprint:
        raise BadRequest("identity.model_fingerprint must not be empty")
    if identity.num_tokens != len(tokens):
        raise BadRequest(f"identity.num_tokens={identity.num_tokens} but {len(tokens)} tokens were sent")
    if identity.frontier_kind not in (pb.FRONTIER_KIND_EXEC, pb.FRONTIER_KIND_CHECKPOINT):
        raise BadRequest("identity.frontier_kind must be EXEC or CHECKPOINT")
    if not 0 < identity.frontier_position <= len(tokens):
        raise BadRequest(f"identity.frontier_position={identity.frontier_position} must be in [1, num_tokens]")
    if any(len(d) < 16 for d in identity.page_digests):
        raise BadRequest("page digests must be at least 16 bytes")
    if layout.total_bytes <= 0:
        raise BadRequest("layout.total_bytes must be > 0")
    if not layout.parts:
        raise BadRequest("layout must declare at least one part")
    names = [p.name for p in layout.parts]
    if len(set(names)) != len(names) or not all(names):
        raise BadRequest("layout part names must be unique and non-empty")
    for p in layout.parts:
        if p.role == pb.PART_ROLE_UNSPECIFIED:
            raise BadRequest(f"part {p.name!r} has no role")
        if p.length <= 0 or p.offset + p.length > layout.total_bytes:
            raise BadRequest(f"part {p.name!r} [{p.offset}, +{p.length}) lies outside total_bytes")
