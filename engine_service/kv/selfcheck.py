"""Start-up check of the device's KV kernels against the plain-torch reference.

On CUDA the quantized pool runs Triton and Gluon kernels whose meaning is the reference
(``kernels/*/reference.py``); the tests compare the two on the machines this project has. A
user's GPU, driver or Triton version is not one of those, and an append that stores other
bytes would corrupt every cached token without a sign. So before serving, ``check_pool``
writes a sample of K/V (the calibration's own: ``QuantKVPool`` layers keep their rotation,
global scales, K centering and rounding, position 0's rule included) through the pool's
backend and through the reference, into scratch pages (the pool itself is not touched), and
compares:

- the cache bytes, which must be equal (an append that raises, e.g. a kernel this Triton
  cannot compile, counts as unequal). Where they are not and the append ran the Gluon
  kernel, the backend falls back to the Triton append (``TritonBackend.append_impl``) and the
  bytes are compared again; unequal still: ``KVKernelCheckError``;
- decode attention (the sample's last token over all of it), prefill attention (the whole
  sample as one chunk, its second half over the first, and a short chunk: its last
  ``SUFFIX_TOKENS`` over the rest), with random queries over the reference's bytes: within
  ``ATTENTION_TOLERANCE`` relative L2 of the reference attention (the kernels' own tests hold
  them to 1e-3 of an fp64 evaluation, so only a broken kernel fails this). A Gluon decode that
  misses it (or raises) is replaced by the Triton decode kernel
  (``TritonBackend.gluon_max_tokens = 0``; the layers checked before are checked again on it);
  a long chunk through cuDNN (``paged_attention.dense_prefill``) that misses it is served by
  the Triton kernel from then on (``TritonBackend.prefill_dense = False``); anything else that
  misses it: ``KVKernelCheckError``.

The first call also compiles each kernel the pool's layers use, ahead of the first request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from deepwell.engine_service.kv.quant_pool import KVBackend, QuantKVPool, append_tokens, describe
from deepwell.kernels.backend import KVCacheLayer, ReferenceBackend, TritonBackend

CHECK_TOKENS = 512  # the most sample tokens per layer (enough rows for the prefill workspace path)
SUFFIX_TOKENS = 16  # the short chunk's tokens (read from the packed pages)
ATTENTION_TOLERANCE = 1e-2  # relative L2 against the reference attention


class KVKernelCheckError(RuntimeError):
    """A KV kernel of this device disagrees with the reference; the message says what to do."""


@dataclass(frozen=True)
class KVKernelCheck:
    """What ``check_pool`` compared: ``append_kernel`` is the append serving after the check
    ("gluon" / "triton"), ``fallback`` why it left the Gluon kernel ("" when it did not),
    ``decode_kernel`` / ``decode_fallback`` the same for decode, the errors the largest
    relative L2 over the layers."""

    backend: str
    layers: int
    tokens: int
    append_kernel: str
    fallback: str
    decode_error: float
    prefill_error: float
    seconds: float
    decode_kernel: str = ""  # the decode serving after the check ("gluon" / "triton")
    decode_fallback: str = ""  # why decode left the Gluon kernel ("" when it did not)
    prefill_fallback: str = ""  # why long prefill chunks left cuDNN for the Triton kernel ("" when they did not)


def synthetic_samples(num_layers: int, num_kv_heads: int, head_dim: int, tokens: int,
                      seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer fp32 ``(k, v)`` ``[tokens, Hkv, d]`` for formats without a calibration (int8):
    Gaussian with a few large elements and a large first token (the range an append must span)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        kv = []
        for _ in range(2):
            x = torch.randn(tokens, num_kv_heads, head_dim, generator=g)
            x = x * (1 + 15 * (torch.rand(x.shape, generator=g) < 0.01))
            x[0] *= 8
            kv.append(x)
        out.append((kv[0], kv[1]))
    return out


def _written(backend: KVBackend, cache: KVCacheLayer, k: torch.Tensor, v: torch.Tensor) -> KVCacheLayer:
    """A scratch copy of ``cache`` (same settings, fresh pages, no counters) holding ``k`` / ``v``
    at positions 0.. as the engine appends a sequence's first chunk."""
    n = k.shape[0]
    dev = cache.data.device
    scratch = replace(cache, data=cache.layout.allocate(-(-n // cache.layout.page_size), dev), scale_counts=None)
    slots = torch.arange(n, device=dev)
    append_tokens(backend, scratch, k, v, slots, slots if cache.page_center is not None else None, [0])
    return scratch


def _first_mismatch(backend: KVBackend, caches: Sequence[KVCacheLayer], samples: Sequence[tuple[torch.Tensor, ...]],
                    expected: Sequence[KVCacheLayer]) -> str:
    """"" when ``backend`` writes every layer's sample as the reference did, else where it does not."""
    for i, (c, (k, v), want) in enumerate(zip(caches, samples, expected, strict=True)):
        kernel = backend.append_kernel(c.layout, want.data.device) if isinstance(backend, TritonBackend) else backend.name
        try:
            got = _written(backend, c, k, v).data
        except Exception as exc:  # e.g. a kernel this Triton cannot compile: as wrong as other bytes
            return f"layer {i} ({describe(c.layout)}): the {kernel} append failed ({type(exc).__name__}: {exc})"
        if not torch.equal(got, want.data):
            bad = int((got != want.data).sum())
            return (f"layer {i} ({describe(c.layout)}): the {kernel} append stored {bad} of {got.numel()} bytes "
                    "other than the reference codec")
    return ""


def _attend(backend: KVBackend, kind: str, q: torch.Tensor, cache: KVCacheLayer, table: torch.Tensor,
            lens: torch.Tensor, scale: float) -> torch.Tensor:
    if kind == "decode":
        return backend.decode_attention(q, cache, table, lens, tokens_per_seq=q.shape[0], sm_scale=scale)
    return backend.prefill_attention(q, cache, table, lens, [q.shape[0]], sm_scale=scale)


def _compare(backend: KVBackend, kind: str, q: torch.Tensor, cache: KVCacheLayer, table: torch.Tensor,
             lens: torch.Tensor, scale: float, want: torch.Tensor) -> tuple[str, float]:
    """("", relative L2 error) of ``backend``'s attention against ``want``, or (what went
    wrong, its error): an exception, or an error over ``ATTENTION_TOLERANCE`` (NaN included)."""
    try:
        got = _attend(backend, kind, q, cache, table, lens, scale)
    except Exception as exc:  # e.g. a kernel this Triton cannot compile
        return f"failed ({type(exc).__name__}: {exc})", float("nan")
    err = _rel(got, want)
    if not err <= ATTENTION_TOLERANCE:
        return (f"differs from the reference by {err:.3g} relative L2 (at most {ATTENTION_TOLERANCE} expected)",
                err)
    return "", err


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    w = want.double()
    return float((got.double() - w).norm() / w.norm().clamp_min(1e-30))


def check_pool(pool: QuantKVPool, samples: Sequence[tuple[torch.Tensor, torch.Tensor]], num_q_heads: int,
               dtype: torch.dtype, *, backend: KVBackend | None = None, seed: int = 0) -> KVKernelCheck:
    """Compare ``backend`` (default the pool's) with the reference on every layer of ``pool``
    (module doc). ``samples``: per layer fp32 ``(k, v)`` ``[N, Hkv, d]`` (after RoPE,
    unrotated; the first ``CHECK_TOKENS`` are used, N >= 2), cast to ``dtype`` as the model
    writes them. Raises ``KVKernelCheckError``; may set ``backend.append_impl`` to "triton"."""
    t0 = time.perf_counter()
    be = backend or pool.backend
    caches = pool.caches
    if len(samples) != len(caches):
        raise ValueError(f"need K/V samples for {len(caches)} attention layers, got {len(samples)}")
    n = min(CHECK_TOKENS, *(k.shape[0] for k, _ in samples))
    if n < 2:
        raise ValueError(f"the check needs at least 2 sample tokens, got {n}")
    dev = caches[0].data.device
    data = [(k[:n].to(device=dev, dtype=dtype).contiguous(), v[:n].to(device=dev, dtype=dtype).contiguous())
            for k, v in samples]
    ref = ReferenceBackend()
    expected = [_written(ref, c, k, v) for c, (k, v) in zip(caches, data, strict=True)]
    blocks = any(c.layout.hadamard_block for c in caches)
    advice = ("serve with another --kv-dtype (bf16 is always exact)"
              + (" or with --kv-hadamard on (no layer's K rotated per 16-element block)" if blocks else "")
              + f", and report it with this message (torch {torch.__version__}, triton {_triton_version()}, "
              f"device {_device_name(dev)})")
    fallback = _first_mismatch(be, caches, data, expected)
    if fallback and isinstance(be, TritonBackend) and be.append_impl == "auto" and \
            be.append_kernel(caches[0].layout, dev) == "gluon":
        be.append_impl = "triton"
        if err := _first_mismatch(be, caches, data, expected):
            raise KVKernelCheckError(f"{fallback}; {err}: {advice}")
    elif fallback:
        raise KVKernelCheckError(f"{fallback}: {advice}")
    g = torch.Generator().manual_seed(seed)
    d = pool.layout.head_dim
    group = num_q_heads // pool.layout.num_kv_heads
    decode_fallback = prefill_fallback = ""
    scale = 1.0 / math.sqrt(d)
    suffix = min(SUFFIX_TOKENS, n - 1)
    table = torch.arange(expected[0].data.shape[0], dtype=torch.int32, device=dev)[None]
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    worst = {"decode": 0.0, "prefill": 0.0}
    for i, cache in enumerate(expected):
        q = torch.randn(n, num_q_heads, d, generator=g).to(device=dev, dtype=dtype)
        # the whole sample, its second half over the first (a long chunk over a prefix: the
        # cuDNN path's parts and merge where it serves), and a short chunk
        for kind, rows in (("decode", 1), ("prefill", n), ("prefill", n - n // 2), ("prefill", suffix)):
            want = _attend(ref, kind, q[-rows:], cache, table, lens, scale)
            problem, err = _compare(be, kind, q[-rows:], cache, table, lens, scale, want)
            if problem and kind == "prefill" and isinstance(be, TritonBackend) and \
                    be._dense(cache, rows * group, dev):  # the Triton kernel instead, checked again
                prefill_fallback = f"layer {i} ({describe(cache.layout)}): the cudnn prefill {problem}"
                be.prefill_dense = False
                problem, err = _compare(be, kind, q[-rows:], cache, table, lens, scale, want)
            gluon = kind == "decode" and isinstance(be, TritonBackend) and be.uses_gluon(cache.layout, group, 1, dev)
            if problem and gluon:  # the Triton decode kernel instead of the Gluon one, checked again
                assert isinstance(be, TritonBackend)
                decode_fallback = f"layer {i} ({describe(cache.layout)}): the gluon decode {problem}"
                be.gluon_max_tokens = 0
                for earlier in expected[:i]:  # the layers already checked, on the Triton kernel now
                    q0 = torch.randn(1, num_q_heads, d, generator=g).to(device=dev, dtype=dtype)
                    bad, e0 = _compare(be, kind, q0, earlier, table, lens, scale,
                                       _attend(ref, kind, q0, earlier, table, lens, scale))
                    if bad:
                        raise KVKernelCheckError(f"{decode_fallback}; the triton decode {bad}: {advice}")
                    worst[kind] = max(worst[kind], e0)
                problem, err = _compare(be, kind, q[-rows:], cache, table, lens, scale, want)
            if problem:
                where = (f"layer {i} ({describe(cache.layout)}): {be.name} {kind} attention of {rows} queries over "
                         f"{n} tokens")
                raise KVKernelCheckError(f"{decode_fallback + '; ' if decode_fallback else ''}{where} {problem}: "
                                         f"{advice}")
            worst[kind] = max(worst[kind], err)
    kernel = be.append_kernel(caches[0].layout, dev) if isinstance(be, TritonBackend) else be.name
    decode = ("gluon" if be.uses_gluon(pool.layout, group, 1, dev) else "triton") if isinstance(be, TritonBackend) \
        else be.name
    return KVKernelCheck(be.name, len(caches), n, kernel, fallback, worst["decode"], worst["prefill"],
                         time.perf_counter() - t0, decode, decode_fallback, prefill_fallback)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
