"""The meaning of the 16-bit GEMV kernel: ``x @ w.T (+ bias)``, plain torch.

``torch.nn.functional.linear`` in the activation dtype: products of the stored values summed
in fp32 (what cuBLAS does for bf16 / fp16 inputs; fp32 inputs in fp32, without TF32 unless
torch's ``allow_tf32`` is on), the bias added, one rounding to the activation dtype at the
end. The Triton kernel differs from it by the fp32 summation order only.
"""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` times ``w [N, K]`` transposed, plus ``bias [N]``: ``[M, N]`` in x's dtype."""
    return torch.nn.functional.linear(x, w, bias)
