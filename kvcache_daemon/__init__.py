"""kvcache_daemon — standalone process owning the shared host arena for KV and state.

Contract: serves ``deepwell.kvcache.v1.KVCache`` over a unix socket (TCP optional). Never
imports torch, ``engine_service`` or ``gateway``; never interprets the bytes it stores.
Invariants: see docs/architecture.md ("KV-cache daemon").
"""
