"""deepwell.engine_service.layers — the model maths in plain torch, each layer in one place.

``backend.py`` holds the hot ops (norms, paged attention, causal conv, gated delta rule,
MoE experts) behind one interface so ``kernels/`` can plug in Triton; the modules here
(``attention``, ``gdn``, ``mlp``, ``moe``, ``norm``, ``rope``) hold parameters under HF
names and call the backend. ``context.StepContext`` is the per-step batch metadata.
"""
