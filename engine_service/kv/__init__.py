"""Every KV and recurrent-state pool of the engine, and what the bytes in them mean.

Nothing outside this package knows a KV format. Modules:

- ``settings``: ``KVSettings`` (the four ``--kv-*`` flags) resolved against a model into a
  ``KVSpec`` (layouts and derived switches), or ``KVSettingsError`` saying what to change;
- ``pool``: the ``PagePool`` protocol and the byte movers written once for every pool
  (device copies, export / import of page and slot rows to a flat host buffer);
- ``float_pool``: the float page pool (auto / bf16 / fp16 / fp32);
- ``quant_pool``: the quantized page pool (fp8 / int8 / nvfp4 on ``kernels/``);
- ``state``: the Gated DeltaNet state pool (running sequences and state images);
- ``calibration``: the quantized cache's start-up calibration;
- ``selfcheck``: the start-up check of the device's KV kernels against the reference;
- ``store``: ``KVStore``, the one object the runner holds (pools, calibration, check, movers).
"""
