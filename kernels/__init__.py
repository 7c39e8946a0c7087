"""kernels — Triton kernels, each beside the plain-torch reference that defines its meaning.

Contract: every op has ``reference.py`` (torch, runs anywhere) and a Triton
implementation tested against it (on CPU through ``TRITON_INTERPRET=1`` at small sizes,
on CUDA at full size). The engine picks Triton on CUDA and the reference on CPU.
"""
