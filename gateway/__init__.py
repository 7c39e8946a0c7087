"""gateway — OpenAI/Anthropic HTTP and ``deepwell.gateway.v1.Chat`` gRPC over the engine.

Contract: never touches tensors and never imports ``engine_service`` or
``kvcache_daemon``; talks to engines only through the generated ``deepwell.engine.v1``
client. Owns chat templates, tokenization, turn boundaries, session keys, reasoning and
tool-call parsing.
"""
