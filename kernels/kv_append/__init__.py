"""Fused KV append: ``reference.append`` defines it, ``triton_kernel.append`` matches it byte for byte."""
