"""engine_service — the gRPC engine: scheduler, model runner, KV/state pools, sampling.

Contract: serves ``deepwell.engine.v1.Engine`` (token ids in, token ids out). Never imports
``gateway`` or ``kvcache_daemon``; talks to the daemon only through the generated
``deepwell.kvcache.v1`` client. Runs on CPU with the torch reference ops and on CUDA with
``kernels/``; the same code path either way. See ``runner_api.py`` for the
scheduler <-> model contract.
"""

import kernels as _kernels

if not getattr(_kernels, "DEEPWELL_KERNELS", False):
    raise ImportError(
        f"the 'kernels' package at {getattr(_kernels, '__file__', '?')} is not deepwell's: "
        "Hugging Face's 'kernels' distribution (pulled in by transformers >= 5.25) shadows "
        "deepwell's kernels/ package. Run `pip uninstall kernels` (and keep transformers < 5.25 "
        "in this environment), or run from the deepwell checkout."
    )
