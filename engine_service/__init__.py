"""engine_service — the gRPC engine: scheduler, model runner, KV/state pools, sampling.

Contract: serves ``deepwell.engine.v1.Engine`` (token ids in, token ids out). Never imports
``gateway`` or ``kvcache_daemon``; talks to the daemon only through the generated
``deepwell.kvcache.v1`` client. Runs on CPU with the torch reference ops and on CUDA with
``kernels/``; the same code path either way. See ``runner_api.py`` for the
scheduler <-> model contract.
"""
