"""Batch-invariant CPU inference (``--batch-invariant``): a sequence's numbers never depend on
what else shares its step.

By default a row's result can change in its last bits with the step's make-up, on CPU as on
GPU: MKL's fp32 GEMM takes another kernel below 4 rows (and, with several threads, for some
row counts that are not multiples of 4), and the decode attention pads every row to the
step's longest context. Bits do not change tokens in practice, but they make runs hard to
compare: a speculative verify step (k + 1 rows) leaves a recurrent state that differs from
plain decoding's by ~1e-6, and a request's logits depend on the load.

This mode removes the dependence on the reference (CPU) path, measured on MKL (torch 2.13,
1-8 threads, every linear shape of the tiny and SmolLM2 models):

- every ``nn.Linear`` pads its rows to a multiple of ``ROW_MULTIPLE`` (4) with zeros, which
  makes each row's product the same bits whatever the other rows (``RowPaddedLinear``);
  MoE routers and expert products likewise (``BatchInvariantBackend.linear``);
- the ops with a sigmoid, SiLU or softplus pad their rows to a multiple of 64, so that no
  element falls in torch's scalar tail loop (``ACTIVATION_ROWS``);
- decode attention runs each query over exactly its own context, never a padded one, and a
  speculative verify slice's queries run as those decode rows (``paged_decode_attention``,
  ``verify_attention``);
- the Gated DeltaNet already computes verify slices through the decode ops token by token
  (``layers.gdn``), so with the two above a state after a partial acceptance is the plain
  run's bit for bit (tests/engine/test_batch_invariant.py).

Cost (this project's 2-core CPU, fp32): a one-row linear padded to four takes 1.7-2.8x as
long (MKL's GEMV is faster than its 4-row GEMM) and decode attention loses its batching;
SmolLM2-135M decodes at 0.77x (batch 1) and 0.83x (batch 4) the default's tokens/s
(``benchmarks/engine_bench.py --batch-invariant``). So the mode is off by default. It needs the reference backend and a float KV cache
(the quantized pools' reference kernels are not covered) and one process (no tensor
parallelism): ``EngineConfig`` refuses other combinations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepwell.engine_service.layers.backend import ReferenceBackend, register_backend
from deepwell.engine_service.layers.mlp import replace_linears

ROW_MULTIPLE = 4  # MKL's fp32 GEMM is row-invariant for row counts that are multiples of this
# torch's CPU sigmoid / silu / softplus compute a tensor's last (numel mod vector chunk) elements
# with scalar code, other bits than the SIMD lanes': padding the rows to a multiple of 64 leaves
# no such tail (exp, rsqrt, cos and IEEE arithmetic are the same bits either way; measured)
ACTIVATION_ROWS = 64


def _rows_padded(fn: Callable[..., Any], *rows: torch.Tensor) -> Any:
    """``fn(*rows)`` over the tensors' first dim padded with zeros to a multiple of
    ``ACTIVATION_ROWS``, the padding sliced off every output."""
    n = rows[0].shape[0]
    pad = (-n) % ACTIVATION_ROWS
    if not pad:
        return fn(*rows)
    out = fn(*(torch.cat([r, r.new_zeros(pad, *r.shape[1:])]) for r in rows))
    return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over ``x``'s rows padded with zeros to a multiple of ``ROW_MULTIPLE``."""
    rows = x.reshape(-1, x.shape[-1])
    pad = (-rows.shape[0]) % ROW_MULTIPLE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = F.linear(rows, weight, bias)
    if pad:
        out = out[: out.shape[0] - pad]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class RowPaddedLinear(nn.Linear):
    """``nn.Linear`` whose every call is ``padded_linear`` (``pad_linear_rows``: the same
    parameters, no copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded_linear(x, self.weight, self.bias)


def pad_linear_rows(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a ``RowPaddedLinear``; returns how many."""
    return replace_linears(model, RowPaddedLinear)


class RowInvarianceError(RuntimeError):
    """This CPU's BLAS gives a row of an fp32 product other bits with other rows beside it, even
    at multiples of ``ROW_MULTIPLE`` rows: ``--batch-invariant`` cannot hold here."""


def check_row_invariance(model: nn.Module, max_rows: int = 4 * ROW_MULTIPLE) -> None:
    """``RowInvarianceError`` unless, for every distinct weight shape of ``model``'s linear layers,
    each row of ``padded_linear`` over random fp32 rows gives the same bits with 1 to
    ``max_rows`` rows in the call (at the current thread count). The mode rests on that
    property of the BLAS (measured on MKL with AVX-512 for 1-8 threads, and not found on every
    machine), so it is checked once at start-up rather than assumed."""
    g = torch.Generator().manual_seed(7)
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)})
    for n_out, n_in in shapes:
        w = torch.randn(n_out, n_in, generator=g)
        x = torch.randn(max_rows, n_in, generator=g)
        alone = torch.cat([padded_linear(x[i : i + 1], w) for i in range(max_rows)])
        for m in range(2, max_rows + 1):
            if not torch.equal(padded_linear(x[:m], w), alone[:m]):
                raise RowInvarianceError(
                    f"--batch-invariant cannot hold on this machine: its BLAS gives a row of an fp32 "
                    f"{n_out}x{n_in} product other bits in a call of {m} rows than alone ({torch.get_num_threads()} "
                    f"threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, MKL "
                    f"{'yes' if torch.backends.mkl.is_available() else 'no'}); serve without it")


class BatchInvariantBackend(ReferenceBackend):
    """The reference ops with every row's arithmetic independent of the other rows of a step."""

    name = "reference-invariant"

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token_index: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query per row over exactly its ``lengths[b]`` keys (no padding to the longest): the
        reference's batched form, one row at a time."""
        out = torch.empty_like(q)
        for i, n in enumerate(lengths.tolist()):
            out[i] = super().paged_decode_attention(q[i:i + 1], k_cache, v_cache, token_index[i:i + 1, :n],
                                                    lengths[i:i + 1], scale)[0]
        return out

    def verify_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token_index: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """A verify slice's T queries as T decode rows of contexts ``start + 1 .. start + T``."""
        t = q.shape[0]
        lengths = torch.arange(start + 1, start + t + 1, device=q.device)
        return self.paged_decode_attention(q, k_cache, v_cache, token_index.expand(t, -1), lengths, scale)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return padded_linear(x, weight, bias)

    # -- the ops with sigmoid / silu / softplus: rows padded (``ACTIVATION_ROWS``) ---------------
    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rows_padded(lambda a, b: super(BatchInvariantBackend, self).gated_rms_norm(a, b, weight, eps), x, gate)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _rows_padded(super().silu_mul, gate, up)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _rows_padded(super().silu_and_mul, gate_up)

    def gdn_gating(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rows_padded(lambda x, y: super(BatchInvariantBackend, self).gdn_gating(x, y, A_log, dt_bias), a, b)

    def sigmoid_gate_mul(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _rows_padded(super().sigmoid_gate_mul, o, gate.reshape(o.shape))

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return _rows_padded(super().sigmoid, x)

    def causal_conv1d_decode(self, x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rows_padded(lambda a, b: super(BatchInvariantBackend, self).causal_conv1d_decode(a, b, weight),
                            x, states)


register_backend(BatchInvariantBackend.name, BatchInvariantBackend)
