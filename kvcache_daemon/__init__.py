"""kvcache_daemon — standalone process owning the shared host arena for KV and state.

Contract: serves ``deepwell.kvcache.v1.KVCache`` over a unix socket (TCP optional). Never
imports torch, ``engine_service`` or ``gateway``; never interprets the bytes it stores.
Invariants: DESIGN.md "KV cache daemon protocol" 1-10, restated in ``core`` and enforced
by ``invariants.check``; module map and protocol summary in docs/kvcache.md. The engine's
client lives in ``deepwell.kvclient`` (importable without this package).
"""
