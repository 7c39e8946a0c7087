"""The GDN layer's decode group and verify group on ``gated_delta_rule_pool`` (the recurrent
states read and written in the pool by slot): a layer step through the Triton kernel
(``kernels.gdn.pool_recurrent``; the interpreter on CPU) agrees with the reference backend, and
the reference backend's new form keeps the bits of the old one (gather, ``gated_delta_rule_decode``
/ ``_multi`` with masked g and beta, scatter)."""

from __future__ import annotations

import os

import pytest
import torch

from deepwell.engine_service.layers.backend import ReferenceBackend
from deepwell.engine_service.layers.context import (
    DecodeGroup, PageTables, SeqInfo, StepContext, VerifyGroup, VerifyRecord,
)
from deepwell.engine_service.layers.gdn import GatedDeltaNet, GDNSpec

SPEC = GDNSpec(hidden=32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel=4)
SLOTS = 6
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernel runs (the interpreter on CPU)
runs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                 reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")


class KernelBackend(ReferenceBackend):
    """The reference with ``gated_delta_rule_pool`` on the Triton kernel, on any device."""

    def gated_delta_rule_pool(self, q, k, v, g, beta, pool, slots, lengths=None, out=True, write_back=True):
        from deepwell.kernels.gdn import pool_recurrent

        return pool_recurrent.gated_delta_rule_pool(q, k, v, g, beta, pool, slots, lengths, out, write_back)


class OldForm(ReferenceBackend):
    """``gated_delta_rule_pool`` as the layer computed it before: a gather of ``pool[slots]``,
    the decode op token by token (``gated_delta_rule_multi``) with g and beta zeroed past
    ``lengths``, a scatter."""

    def gated_delta_rule_pool(self, q, k, v, g, beta, pool, slots, lengths=None, out=True, write_back=True):
        if lengths is not None:
            keep = (torch.arange(q.shape[1])[None] < lengths[:, None])[..., None]
            zero = torch.zeros((), dtype=g.dtype)
            g, beta = torch.where(keep, g, zero), torch.where(keep, beta, zero)
        if q.shape[1] == 1:
            o, s = self.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool[slots])
            o = o.unsqueeze(1)
        else:
            o, s = self.gated_delta_rule_multi(q, k, v, g, beta, pool.index_select(0, slots))
        if write_back:
            pool[slots] = s
        return o if out else None


def _layer(backend: ReferenceBackend, seed: int = 0, device: str = "cpu") -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(SPEC, backend)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    layer.A_log.data.uniform_(-1, 0.5)
    return layer.to(device)


def _states(seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(SLOTS, SPEC.conv_dim, SPEC.conv_kernel - 1, generator=gen)
    rec = torch.randn(SLOTS, SPEC.num_v_heads, SPEC.head_k_dim, SPEC.head_v_dim, generator=gen) * 0.1
    return conv.to(device), rec.to(device)


def decode_step(backend: ReferenceBackend, slots: list[int], seed: int = 0, device: str = "cpu"):
    """One decode step of len(slots) sequences: (output, conv pool, recurrent pool)."""
    layer = _layer(backend, seed, device)
    conv, rec = _states(seed + 1, device)
    x = torch.randn(len(slots), SPEC.hidden, generator=torch.Generator().manual_seed(seed + 2)).to(device)
    seqs = tuple(SeqInfo(i, 1, 10 + i, s, None) for i, s in enumerate(slots))
    ctx = StepContext(positions=torch.zeros(len(slots), dtype=torch.long, device=device), kv_slots=None, seqs=seqs,
                      decode=DecodeGroup(rows=torch.arange(len(slots), device=device),
                                         state_slots=torch.tensor(slots, device=device), token_index=None,
                                         lengths=None))
    with torch.no_grad():
        out = layer(x, ctx, conv, rec)
    return out, conv, rec


def verify_group(backend: ReferenceBackend, slots: list[int], t: int, lengths: list[int], seed: int = 0,
                 device: str = "cpu"):
    """A verify group of len(slots) slices of t tokens, then its commit of ``lengths``: (output,
    conv and recurrent pools after the forward, the same after the commit)."""
    layer = _layer(backend, seed, device)
    conv, rec = _states(seed + 1, device)
    b = len(slots)
    x = torch.randn(b * t, SPEC.hidden, generator=torch.Generator().manual_seed(seed + 2)).to(device)
    seqs = tuple(SeqInfo(i * t, t, 10 + i, s, None, verify=True) for i, s in enumerate(slots))
    pages = PageTables(rows=torch.arange(b * t, device=device), block_tables=torch.zeros(b, 1, dtype=torch.int32),
                       context_lens=torch.full((b,), t, dtype=torch.int32), q_lens=(t,) * b)
    ctx = StepContext(positions=torch.zeros(b * t, dtype=torch.long, device=device), kv_slots=None, seqs=seqs,
                      verify=VerifyRecord(),
                      verify_group=VerifyGroup(t, tuple(slots), torch.tensor(slots, device=device), pages))
    with torch.no_grad():
        out = layer(x, ctx, conv, rec)
        before = conv.clone(), rec.clone()
        (commit,) = ctx.verify.group
        commit(torch.tensor(lengths, device=device))
    return out, before, (conv, rec)


def test_reference_keeps_the_old_bits() -> None:
    for a, b in zip(decode_step(ReferenceBackend(), [4, 0, 2]), decode_step(OldForm(), [4, 0, 2])):
        assert torch.equal(a, b)
    new = verify_group(ReferenceBackend(), [3, 1, 5], 4, [0, 2, 4])
    old = verify_group(OldForm(), [3, 1, 5], 4, [0, 2, 4])
    assert torch.equal(new[0], old[0])
    for a, b in zip((*new[1], *new[2]), (*old[1], *old[2])):
        assert torch.equal(a, b)


@runs_kernel
def test_decode_step_through_the_kernel() -> None:
    out, conv, rec = decode_step(KernelBackend(), [4, 0, 2], device=DEV)
    rout, rconv, rrec = decode_step(ReferenceBackend(), [4, 0, 2], device=DEV)
    torch.testing.assert_close(out, rout, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv, rconv)
    torch.testing.assert_close(rec, rrec, rtol=1e-5, atol=1e-6)
    _, rec0 = _states(1, DEV)
    assert torch.equal(rec[[1, 3, 5]], rec0[[1, 3, 5]])  # slots not in the step: untouched


@runs_kernel
def test_verify_group_and_commit_through_the_kernel() -> None:
    slots, lengths = [3, 1, 5], [0, 2, 4]
    out, before, after = verify_group(KernelBackend(), slots, 4, lengths, device=DEV)
    rout, rbefore, rafter = verify_group(ReferenceBackend(), slots, 4, lengths, device=DEV)
    torch.testing.assert_close(out, rout, rtol=1e-4, atol=1e-5)
    conv0, rec0 = _states(1, DEV)
    assert torch.equal(before[0], conv0) and torch.equal(before[1], rec0)  # the forward leaves the slots
    assert torch.equal(after[0], rafter[0])
    torch.testing.assert_close(after[1], rafter[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(after[1][[0, 2, 4, 3]], rec0[[0, 2, 4, 3]])  # not in the group, or 0 accepted
