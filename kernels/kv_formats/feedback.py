"""Query-weighted rounding of K: error feedback inside each 16-element block (fp8, nvfp4).

Nearest rounding makes each stored key's error ``e = k - k_hat`` small in the plain
Euclidean sense, but attention only ever feels it through scores: the error of ``q . k``
over the queries that read the key has mean square ``e^T C e`` with ``C = E[q q^T]``, and
queries are far from isotropic. Rounding the elements of a block one after another and
pushing each element's error onto the block's later elements (the GPTQ recursion, with
``C`` in the role of the Hessian) makes ``e^T C_b e`` small for the block's own part
``C_b`` of ``C``. The bytes keep their format (decoding, attention and the page layout are
unchanged); only which codes the encoder picks changes. On SmolLM2 (``benchmarks/kv_quality.py``,
10 windows, docs/kernels.md) it lowers the KL to the bf16 cache by 40% for fp8 and by a third
for nvfp4.

A K feedback tensor ``F`` is fp32 ``[num_kv_heads, d/16, 16, 16]``, per (head, block): row
``i`` holds how much of element ``i``'s error each element of the block takes (only the
entries right of the diagonal matter). ``from_block_covariance`` derives it from the
calibration queries (in K's stored basis: Hadamard-rotated when the layout rotates): with
``H = C_b + damp * mean(diag C) * I`` and ``U`` the upper Cholesky factor of ``H^-1``,
``F[i, k] = U[i, k] / U[i, i]`` for ``k > i`` (the GPTQ update restricted to one block;
``damp`` keeps it well conditioned where few queries were seen).

Rounding one row of one head (fp32, every product and difference rounded on its own: no
fused multiply-add, so the Triton kernel reproduces it bit for bit), blocks side by side:

    w = x                                    # [d/16, 16], the row after centering / rotation
    for i in 0 .. 15:
        code_i = format rounding of w[:, i]  # nvfp4: E2M1 under the block scale chosen from x
        e = w[:, i] - value(code_i)          # value exact: E2M1 * s * g, or E4M3 * g
        w = w - e[:, None] * F[:, i, :]      # product, then difference

The nvfp4 block scale is still chosen by the codec's search on ``x`` itself (the feedback
only moves elements within the grid that scale defines).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BLOCK = 16
DEFAULT_DAMP = 0.01  # relative to the mean query energy per channel (SmolLM2 screening: 0.01 best of 0.001-0.1)


def shape(num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    return (num_kv_heads, head_dim // BLOCK, BLOCK, BLOCK)


def check(feedback: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """``feedback`` must be finite contiguous fp32 ``[Hkv, d/16, 16, 16]``; ValueError saying why not."""
    want = shape(num_kv_heads, head_dim)
    if feedback.dtype != torch.float32 or tuple(feedback.shape) != want or not feedback.is_contiguous():
        raise ValueError(f"k_feedback must be contiguous float32 {list(want)}, got {feedback.dtype} "
                         f"{list(feedback.shape)}")
    if not bool(torch.isfinite(feedback).all()):
        raise ValueError("k_feedback must be finite")


def block_covariance(q: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, int]:
    """Sums over the queries ``q`` [N, Hq, d] (already in K's stored basis) of each KV head's
    query group: (block products fp64 ``[Hkv, d/16, 16, 16]``, number of query vectors)."""
    n, hq, d = q.shape
    qb = q.double().reshape(n, num_kv_heads, hq // num_kv_heads, d // BLOCK, BLOCK)
    return torch.einsum("nhgbi,nhgbj->hbij", qb, qb), n * (hq // num_kv_heads)


def from_block_covariance(cov: torch.Tensor, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """fp32 feedback ``[Hkv, d/16, 16, 16]`` from the mean block products ``cov`` (fp64, same
    shape; ``block_covariance`` divided by its count). A head whose queries were all zero
    gets zero feedback (nearest rounding)."""
    if damp <= 0:
        raise ValueError(f"damp must be > 0, got {damp}")
    h, nb, bs, _ = cov.shape
    eye = torch.eye(bs, dtype=torch.float64, device=cov.device)
    energy = torch.diagonal(cov.double(), dim1=-2, dim2=-1).mean(dim=(1, 2))  # [Hkv]
    out = torch.zeros(cov.shape, dtype=torch.float64, device=cov.device)
    for head in range(h):
        if not float(energy[head]) > 0:
            continue
        hm = cov[head].double() + damp * energy[head] * eye
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hm)), upper=True)
        out[head] = torch.triu(u / torch.diagonal(u, dim1=-2, dim2=-1)[..., None], diagonal=1)
    return out.to(torch.float32).contiguous()


def round_blocks(x: torch.Tensor, feedback: torch.Tensor,
                 quantize: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The recursion above on fp32 rows ``x`` [N, d] with per-row feedback ``[N, d/16, 16, 16]``;
    ``quantize(column [N, d/16], i) -> (code int32, value fp32)`` is the format's rounding of
    column ``i`` of every block. Returns the codes int32 ``[N, d]``."""
    n, d = x.shape
    w = x.to(torch.float32).reshape(n, d // BLOCK, BLOCK).clone()
    codes = torch.empty(w.shape, dtype=torch.int32, device=x.device)
    for i in range(BLOCK):
        col = w[:, :, i]
        code, value = quantize(col, i)
        codes[:, :, i] = code
        err = col - value
        w = w - err[:, :, None] * feedback[:, :, i, :]
    return codes.reshape(n, d)
