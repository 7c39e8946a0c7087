"""A long prefill chunk's attention through cuDNN's fused attention over dense K / V.

``TritonBackend.prefill_attention`` serves a long chunk of a quantized cache by unpacking its
context into fp16 and attending over that; at the Qwen3.5-27B layout (d = 256, 24 query heads
over 4 KV heads) its Triton kernel reaches ~420 TFLOP/s on an H100 where cuDNN's fused
attention (through torch) reaches ~660-690 with the KV heads shared natively
(``benchmarks/prefill_sdpa.py``). cuDNN reads K / V as dense ``[B, H, S, d]`` tensors and masks
causally from the top left only, so a chunk of ``n`` queries at the end of a context of
``P + n`` keys is attended in parts:

- the prefix, keys ``[0, P)``, without a mask, in segments that fit the workspace budget;
- the chunk's own keys ``[P, P + n)``, causal (a square: top left is the diagonal);

each part returns its output and the log-sum-exp of its scores, and the parts are folded
together exactly (``merge``): ``o = sum_i o_i exp(lse_i - m) / sum_i exp(lse_i - m)``.

``available`` says whether this device's torch has the cuDNN op and which base its
log-sum-exp is in (probed once per device on a case whose answer is known: ``ln`` of the key
count, or ``log2``); a device whose op fails or answers neither serves with the Triton kernel.
``attend_reference`` is the meaning in plain torch (fp32 scores, the same parts and merge).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

Tensor = torch.Tensor
# lse units per natural-log unit: 1.0 (natural) or 1 / ln 2 (base 2); per CUDA device index
_LSE_UNIT: dict[int, float | None] = {}
ENV_DISABLE = "DEEPWELL_PREFILL_CUDNN"  # "0": never use this path (A/B against the Triton kernel)


def _probe(device: torch.device) -> float | None:
    """The cuDNN op's log-sum-exp unit on ``device``: zero queries over 128 keys score 0
    everywhere, so the log-sum-exp is ``ln 128`` (natural) or ``7`` (base 2); None if the op
    fails or answers anything else."""
    try:
        q = torch.zeros(1, 2, 64, 128, dtype=torch.float16, device=device)
        kv = torch.randn(1, 1, 128, 128, dtype=torch.float16, device=device)
        _, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kv, kv, None, True, 0.0, False, False,
                                                                    scale=0.0625)[:2]
        got = float(lse.float().mean())
    except Exception:  # no cuDNN attention on this torch / GPU / shape
        return None
    for unit in (1.0, 1.0 / math.log(2.0)):
        if abs(got - math.log(128.0) * unit) < 1e-3:
            return unit
    return None


def available(device: torch.device) -> bool:
    """Whether chunks on ``device`` may go through cuDNN: CUDA, compute capability 9.0 or newer
    (where it was measured faster), the op present and its log-sum-exp understood
    (``_probe``), and ``DEEPWELL_PREFILL_CUDNN`` not ``0``."""
    if device.type != "cuda" or os.environ.get(ENV_DISABLE, "") == "0":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _LSE_UNIT:
        major, _ = torch.cuda.get_device_capability(key)
        _LSE_UNIT[key] = _probe(torch.device("cuda", key)) if major >= 9 else None
    return _LSE_UNIT[key] is not None


def _part(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float, unit: float) -> tuple[Tensor, Tensor]:
    """cuDNN attention of ``q [1, Hq, n, d]`` over ``k, v [1, Hkv, s, d]``: (o fp32 ``[n, Hq, d]``,
    natural log-sum-exp fp32 ``[n, Hq]``)."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                scale=sm_scale)[:2]
    n, hq = q.shape[2], q.shape[1]
    return o[0].transpose(0, 1).float(), lse.reshape(hq, n).t().float() / unit


def _part_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float) -> tuple[Tensor, Tensor]:
    """``_part`` in plain torch: fp32 scores, query heads sharing their KV head."""
    hq, hkv = q.shape[1], k.shape[1]
    qf = q[0].float()  # [Hq, n, d]
    kf = k[0].float().repeat_interleave(hq // hkv, 0)
    vf = v[0].float().repeat_interleave(hq // hkv, 0)
    s = torch.einsum("hnd,hsd->hns", qf, kf) * sm_scale
    if causal:
        n, m = s.shape[1], s.shape[2]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, n]
    o = torch.einsum("hns,hsd->hnd", torch.exp(s - lse[..., None]), vf)
    return o.transpose(0, 1), lse.t()


def merge(o_run: Tensor, lse_run: Tensor, o: Tensor, lse: Tensor) -> None:
    """Fold a part ``(o [n, Hq, d], lse [n, Hq])`` into the running ``(o_run, lse_run)`` in
    place (fp32; ``lse_run`` starts at ``-inf``, ``o_run`` at anything finite)."""
    m = torch.maximum(lse_run, lse)
    w_run, w = torch.exp(lse_run - m), torch.exp(lse - m)
    total = w_run + w
    o_run.mul_((w_run / total)[..., None]).add_(o * (w / total)[..., None])
    lse_run.copy_(m + torch.log(total))


DenseKV = Callable[[int, int], tuple[Tensor, Tensor]]  # (first page, end page) -> K, V [Hkv, pages * 64, d]


def attend(q: Tensor, dense: DenseKV, context_len: int, page_size: int, segment_pages: int, sm_scale: float,
           out: Tensor, reference: bool = False) -> Tensor:
    """One sequence's chunk ``q [n, Hq, d]`` (its last ``n`` tokens of ``context_len``, already
    in the cache) into ``out [n, Hq, d]``: the prefix in segments of at most ``segment_pages``
    pages, then the chunk's own keys causally, merged (module doc). ``dense(lo, hi)`` gives the
    dense K and V of pages ``[lo, hi)`` in the dtype ``q`` is converted to. ``reference``: the
    parts in plain torch instead of cuDNN."""
    n, hq, d = q.shape
    prefix = context_len - n
    if n < 1 or prefix < 0:
        raise ValueError(f"a chunk of {n} tokens cannot end a context of {context_len}")
    if segment_pages < 1:
        raise ValueError(f"segment_pages must be >= 1, got {segment_pages}")
    unit = 1.0
    if not reference:
        if not available(q.device):
            raise RuntimeError("cuDNN attention is not available on this device (dense_prefill.available)")
        unit = _LSE_UNIT[q.device.index if q.device.index is not None else torch.cuda.current_device()]
    part = _part_reference if reference else (lambda *a: _part(*a, unit))  # type: ignore[misc]
    first = -(-prefix // page_size) if prefix else 0  # pages holding prefix keys
    lo_self = prefix // page_size

    def chunk_part(lo: int, hi: int, k0: int, k1: int, causal: bool) -> tuple[Tensor, Tensor]:
        k, v = dense(lo, hi)
        q4 = q.to(k.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hq, n, d] (a view when the dtypes agree)
        base = lo * page_size
        return part(q4, k[None, :, k0 - base : k1 - base], v[None, :, k0 - base : k1 - base], causal, sm_scale)

    o_self, lse_self = chunk_part(lo_self, -(-context_len // page_size), prefix, context_len, True)
    if prefix == 0:
        out.copy_(o_self)
        return out
    o_run, lse_run = o_self, lse_self.clone()
    o_run = o_run.clone()
    for lo in range(0, first, segment_pages):
        hi = min(lo + segment_pages, first)
        merge(o_run, lse_run, *chunk_part(lo, hi, lo * page_size, min(hi * page_size, prefix), False))
    out.copy_(o_run)
    return out
