"""Paged attention over the quantized cache: ``reference`` defines it, ``triton_kernel`` runs it
(decode / speculative verify with split-K, and prefill, one kernel family)."""
