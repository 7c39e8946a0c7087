"""Perplexity of SmolLM2-135M-Instruct through the engine's own KV cache (CPU, reference backend).

    python benchmarks/kv_quality_engine.py [--tokens 20480] [--ctx 2048] [--chunk 512]
        [--configs bf16,fp8,int8,nvfp4,nvfp4:hadamard=off] [--served-context N] [--threads 2]

Where ``benchmarks/kv_quality.py`` passes K/V through the codecs inside ``transformers``
(to screen encodings), this one runs what the server runs: the engine's model runner
(``engine_service.runner.TorchModelRunner``, fp32 weights of the default GGUF, the torch
reference kernels) with a paged KV pool of each ``--kv-dtype``, calibrated at start-up as
``deepwell up`` does (``engine_service.cli.calibrate_kv``: the built-in calibration text,
K centering for ``--served-context`` positions, K rounding per ``--kv-k-rounding``). The
corpus is Python's ``pydoc_data.topics`` text in non-overlapping windows of ``--ctx``
tokens, each prefilled in ``--chunk``-token chunks with every position's logits returned
(``SeqSlice.all_logits``): the chunks read the cache the earlier ones wrote, as the engine's
chunked prefill does. Config specs: ``KV[:hadamard=auto|on|off|layer][:center=auto|on|off|page]
[:rounding=auto|nearest|feedback][:sink=on|off]`` (the engine's ``--kv-*`` options; ``sink=off``
calibrates page 0's K center as every page's instead of on the sink key, an ablation with no
engine option); ``bf16`` runs first
in every window and is the reference of "vs bf16" and of the KL column (mean KL of the
next-token distribution from the bf16 cache's, 1e-3 nats per token). Block-scale counts are
the pool's served counters (fp8 counts elements).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from deepwell.engine_service.kv.quant_pool import CENTER_K_MODES, HADAMARD_MODES, K_ROUNDING_MODES  # noqa: E402

DEFAULT_CONFIGS = "bf16,fp8,int8,nvfp4,nvfp4:hadamard=off"
# the engine's --kv-hadamard / --kv-center-k / --kv-k-rounding choices, and whether page 0 is
# centered on the sink key
OPTIONS = {"hadamard": HADAMARD_MODES, "center": CENTER_K_MODES, "rounding": K_ROUNDING_MODES, "sink": ("on", "off")}


@dataclass(frozen=True)
class Spec:
    text: str
    kv: str
    hadamard: str = "auto"
    center: str = "auto"
    rounding: str = "auto"
    sink: str = "on"  # off: page 0 centered on its mean like every page (ablation of the sink key)


def parse_spec(text: str) -> Spec:
    kv, *opts = text.split(":")
    if kv not in ("bf16", "fp16", "fp32", "fp8", "int8", "nvfp4"):
        raise ValueError(f"{text!r}: the KV dtype must be one of bf16, fp16, fp32, fp8, int8, nvfp4")
    got: dict[str, str] = {}
    for o in opts:
        key, _, value = o.partition("=")
        if key not in OPTIONS or value not in OPTIONS[key]:
            raise ValueError(f"{text!r}: options are " + ", ".join(f"{k}={'|'.join(v)}" for k, v in OPTIONS.items()))
        got[key] = value
    return Spec(text, kv, **got)


def corpus_ids(tokenizer_json: bytes) -> list[int]:
    """``kv_quality.corpus_text`` (the same corpus) in the engine's tokens."""
    from tokenizers import Tokenizer

    from benchmarks.kv_quality import corpus_text

    return Tokenizer.from_str(tokenizer_json.decode("utf-8")).encode(corpus_text(), add_special_tokens=False).ids


def window_logprobs(runner, ids: list[int], chunk: int) -> torch.Tensor:
    """log-softmax of the logits at every position but the last, prefilled in chunks."""
    from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice

    table = list(range(math.ceil(len(ids) / runner.page_size)))
    rows = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        rows.append(runner.forward(ForwardBatch(torch.tensor(part), [SeqSlice(-1, table, start, len(part),
                                                                               all_logits=True)])))
    return torch.log_softmax(torch.cat(rows)[:-1], dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20480, help="tokens scored (rounded up to whole windows)")
    ap.add_argument("--ctx", type=int, default=2048, help="window (context) length")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated specs (default {DEFAULT_CONFIGS})")
    ap.add_argument("--served-context", type=int, default=0,
                    help="positions K centering is calibrated for (default: the model's context, as deepwell up)")
    args = ap.parse_args()
    try:
        specs = [parse_spec(s) for s in args.configs.split(",") if s]
    except ValueError as e:
        ap.error(str(e))
    if args.ctx < 2 or args.chunk < 1 or args.tokens < 1:
        ap.error("--ctx must be >= 2, --chunk and --tokens >= 1")
    specs = [Spec("bf16", "bf16")] + [s for s in specs if s.text != "bf16"]
    torch.set_num_threads(args.threads)
    from deepwell.logs import setup_logging

    setup_logging("kv_quality_engine", "warning")  # the table only (the engine logs every allocation)
    from deepwell.engine_service.cli import calibrate_kv
    from deepwell.engine_service.default_model import ensure_default_model
    from deepwell.engine_service.kv.quant_pool import KVSettingsError
    from deepwell.engine_service.kv.settings import KVSettings
    from deepwell.engine_service.loading import open_model
    from deepwell.engine_service.runner import TorchModelRunner, build_runner

    source = open_model(ensure_default_model())
    base = build_runner(source, "cpu", torch.float32)
    if args.ctx > base.max_context:
        ap.error(f"--ctx {args.ctx} exceeds the model's context {base.max_context}")
    served = args.served_context or base.max_context
    ids = corpus_ids(source.files["tokenizer.json"]())
    windows = math.ceil(args.tokens / args.ctx)
    if len(ids) < windows * args.ctx:
        raise SystemExit(f"the corpus has only {len(ids)} tokens, {windows * args.ctx} needed")
    runners = {}
    for s in specs:
        try:
            r = TorchModelRunner(base.model, torch.device("cpu"), torch.float32,
                                 KVSettings(s.kv, hadamard=s.hadamard, center_k=s.center, k_rounding=s.rounding), 64)
        except KVSettingsError as e:
            ap.error(f"{s.text}: {e}")
        r.allocate(math.ceil(args.ctx / 64), 0)
        cal = calibrate_kv(source, r, served_context=served, sink=s.sink == "on")
        runners[s.text] = r
        if cal is not None:
            print(f"{s.text}: calibrated on {cal.tokens} tokens ({cal.source}), {cal.centered_channels} K channels "
                  f"centered, K rounding {'feedback' if cal.k_feedback is not None else 'nearest'}, K rotation "
                  f"{cal.kv_format}", flush=True)
    print(f"{windows} windows x {args.ctx} tokens of pydoc_data.topics in {args.chunk}-token chunks; "
          f"served context {served}", flush=True)
    stats = {s.text: dict(nll=0.0, kl=0.0, n=0, secs=0.0) for s in specs}
    for w in range(windows):
        x = ids[w * args.ctx : (w + 1) * args.ctx]
        target = torch.tensor(x[1:])
        for s in specs:
            t0 = time.time()
            logp = window_logprobs(runners[s.text], x, args.chunk)
            st = stats[s.text]
            if s.text == "bf16":
                ref = logp
            else:
                st["kl"] += float((ref.exp() * (ref - logp)).sum())
            st["nll"] += float(torch.nn.functional.nll_loss(logp, target, reduction="sum"))
            st["n"] += len(x) - 1
            st["secs"] += time.time() - t0
        print_table(specs, stats, runners, w + 1)
    return 0


def print_table(specs: list[Spec], stats: dict, runners: dict, done: int) -> None:
    base = math.exp(stats["bf16"]["nll"] / stats["bf16"]["n"])
    print(f"\nafter {done} window(s), {stats['bf16']['n']} scored tokens:")
    print("| config | perplexity | vs bf16 | KL to bf16 (1e-3 nats/token) | K scales zero/subnormal/saturated "
          "| V scales zero/subnormal/saturated | s/window |")
    print("|---|---|---|---|---|---|---|")
    for s in specs:
        st = stats[s.text]
        ppl = math.exp(st["nll"] / st["n"])
        counts = runners[s.text].kv_scale_counts()
        kc, vc = (("-", "-") if counts is None else
                  tuple(f"{c.zero}/{c.subnormal}/{c.saturated} of {c.blocks}" for c in counts))
        print(f"| {s.text} | {ppl:.4f} | {(ppl / base - 1) * 100:+.3f}% | {st['kl'] / st['n'] * 1e3:.2f} | {kc} | {vc} "
              f"| {st['secs'] / done:.1f} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
