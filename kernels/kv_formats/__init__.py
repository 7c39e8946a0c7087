"""KV-cache formats: reference codecs (they define each format) and the paged layout.

- ``layout``: ``KVFormat``, ``KVLayout`` (bytes per token/page, cache allocation), global
  scale rules. The byte layout of a page is documented there and in ``docs/kernels.md``.
- ``bf16`` / ``fp8`` / ``int8`` / ``nvfp4``: row codecs ``encode(x[N, d] fp32, g[N]) ->
  (codes uint8 [N, code_bytes], scales uint8 [N, scale_bytes])`` and ``decode`` back to fp32.
  Rounding is round-half-even with saturation, zero encodes to zero, and each step is exact
  fp32 arithmetic so the Triton append reproduces the bytes exactly.
- ``e4m3``: the E4M3 rounding shared by fp8 codes and nvfp4 block scales.
- ``feedback``: query-weighted rounding of K (fp8 / nvfp4 ``encode(..., feedback=F)``):
  other codes of the same format, chosen for the queries that will read them.
"""

from deepwell.kernels.kv_formats.layout import (
    CODECS,
    PAGE_SIZE,
    KVFormat,
    KVLayout,
    check_global_scales,
    default_hadamard,
)

__all__ = ["CODECS", "PAGE_SIZE", "KVFormat", "KVLayout", "check_global_scales", "default_hadamard"]
