"""kernels — KV-cache formats and attention kernels, each Triton kernel beside the plain-torch
reference that defines its meaning.

Contract: every op has a ``reference.py`` (torch, runs anywhere) and a Triton implementation
tested against it (on CPU through ``TRITON_INTERPRET=1`` at small sizes, on CUDA at full
size). The engine calls ``kernels.backend`` (``get_backend(device)``: Triton on CUDA, the
reference on CPU). Packages:

- ``kv_formats``: bf16 / fp8 / int8 / nvfp4 row codecs and the paged byte layout;
- ``hadamard``: the normalized Walsh-Hadamard rotation of K (and Q);
- ``kv_append``: fused (rotate) + quantize + scatter into pages; Triton is byte-identical;
- ``paged_attention``: decode / speculative verify (split-K) and prefill over the cache;
- ``calibration``: power-of-two global scales and block-scale health counters.
- ``pdl``, ``cuda_arch``, ``e4m3_unpack``: shared launch helpers (programmatic dependent
  launch, the device's compute capability, E4M3 bytes to fp16 on every GPU generation).

Only torch, triton and numpy are imported (no ``deepwell`` services, no structlog), so the
kernels and their benchmarks run on a bare GPU image. Full description: ``docs/kernels.md``.
"""
