"""KL of the engine's quantized KV cache to its fp32 pool on chat prompts (SmolLM2, CPU).

    python benchmarks/kv_chat_quality.py [--kv fp8,nvfp4] [--tokens 16] [--gguf PATH]
        [--hadamard auto|on|off|layer] [--default-only]

For each of eight chat prompts (a plain question, a coding-agent and a tool-calling system
prompt, a traceback, a summary, a translation, two short questions) the fp32 pool's greedy
continuation of ``--tokens`` tokens is fed to a quantized engine runner (teacher forcing;
start-up calibration on the built-in text, as ``deepwell up`` does), and the KL divergence
of its next-token distribution from the fp32 pool's is averaged: at the first generated
position and over all of them. Each format runs with the engine's default K rounding
(query-weighted, ``--kv-k-rounding auto``) twice: with a sequence's position 0 rounded to
nearest and without (``engine_service.kv.quant_pool.position0_nearest`` switched for the run),
then with nearest rounding everywhere; and the first of those with page 0's K centered on its
page mean instead of on the sink key (``calibrate_kv(..., sink=False)``, the rule before
2026-12-02). ``--hadamard`` is the engine's ``--kv-hadamard`` for every run; ``--default-only``
runs the engine's defaults alone (nvfp4: the first configuration, fp8: the third). Prints one line per configuration,
then the per-prompt figures (first / mean).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import deepwell.engine_service.kv.quant_pool as kv_quant  # noqa: E402
from deepwell.engine_service.kv.settings import KVSettings  # noqa: E402
from benchmarks.kv_quality import find_gguf  # noqa: E402
from deepwell.engine_service.cli import calibrate_kv  # noqa: E402
from deepwell.engine_service.kv.quant_pool import HADAMARD_MODES  # noqa: E402
from deepwell.engine_service.loading import open_model  # noqa: E402
from deepwell.engine_service.runner import TorchModelRunner, build_runner  # noqa: E402
from deepwell.engine_service.runner_api import ForwardBatch, SeqSlice  # noqa: E402

SYSTEM = "<|im_start|>system\n{}<|im_end|>\n"
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    USER.format("What is the capital of France?"),
    SYSTEM.format("You are a coding agent working in a git repository. Use the tools to read files, run tests "
                  "and edit code. Keep answers short.")
    + USER.format("The test suite fails with ImportError in utils/io.py. Fix it."),
    SYSTEM.format('You can call tools. To call one, answer with <tool_call>{"name": ..., "arguments": {...}}'
                  "</tool_call>. Tools: get_weather(city), search(query).")
    + USER.format("What's the weather in Lyon today?"),
    USER.format('Explain this error:\nTraceback (most recent call last):\n  File "main.py", line 3, in <module>\n'
                "    print(items[5])\nIndexError: list index out of range"),
    USER.format("Summarize in one sentence: The committee met on Tuesday to review the budget. After a long "
                "debate, it approved the new plan, with two members voting against it."),
    USER.format("Translate to French: The library opens at nine and closes at six."),
    USER.format("What is 17 times 23?"),
    USER.format("Name three primary colors."),
]
PAGES = 8  # 512 tokens per sequence, pages used in this fragmented order
TABLE = [5, 0, 7, 2, 1, 3, 6, 4]


def forced(runner: TorchModelRunner, ids: list[int], cont: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt and after each of ``cont[:-1]`` fed one token per step."""
    out = [runner.forward(ForwardBatch(torch.tensor(ids), [SeqSlice(-1, TABLE, 0, len(ids))]))[0]]
    for i, t in enumerate(cont[:-1]):
        out.append(runner.forward(ForwardBatch(torch.tensor([t]), [SeqSlice(-1, TABLE, len(ids) + i, 1)]))[0])
    return out


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True, reduction="sum"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="fp8,nvfp4", help="comma-separated formats (fp8, int8, nvfp4)")
    ap.add_argument("--tokens", type=int, default=16, help="teacher-forced tokens per prompt")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hadamard", default="auto", choices=HADAMARD_MODES,
                    help="the engine's --kv-hadamard for every run")
    ap.add_argument("--default-only", action="store_true", help="only the engine's default configuration")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    source = open_model(find_gguf(args.gguf))
    tok = Tokenizer.from_str(source.files["tokenizer.json"]().decode("utf-8"))
    base = build_runner(source, "cpu", torch.float32)
    base.allocate(PAGES, 0)
    refs = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        if len(ids) + args.tokens > PAGES * 64:
            raise SystemExit(f"prompt of {len(ids)} tokens + {args.tokens} does not fit {PAGES * 64}")
        cont, logits = [], forced(base, ids, [])[0]
        while True:  # the fp32 pool's greedy continuation
            cont.append(int(logits.argmax()))
            if len(cont) == args.tokens:
                break
            step = [SeqSlice(-1, TABLE, len(ids) + len(cont) - 1, 1)]
            logits = base.forward(ForwardBatch(torch.tensor(cont[-1:]), step))[0]
        refs.append((ids, cont, forced(base, ids, cont)))
    default_rule = kv_quant.position0_nearest
    for fmt in args.kv.split(","):
        runs = (("feedback, position 0 nearest", "auto", lambda lay: True, True),
                ("the same, page 0 on its mean", "auto", lambda lay: True, False),
                ("feedback on every token", "auto", lambda lay: False, True),
                ("nearest", "nearest", default_rule, True))
        if args.default_only:
            runs = (("the engine's defaults", "auto", default_rule, True),)
        for name, rounding, rule, sink in runs:
            kv_quant.position0_nearest = rule
            r = TorchModelRunner(base.model, torch.device("cpu"), torch.float32,
                                 KVSettings(fmt, hadamard=args.hadamard, k_rounding=rounding), 64)
            r.allocate(PAGES, 0)
            calibrate_kv(source, r, sink=sink)
            rows = []
            for ids, cont, ref in refs:
                ks = [kl(a, b) for a, b in zip(ref, forced(r, ids, cont), strict=True)]
                rows.append((ks[0], sum(ks) / len(ks)))
            first = sum(a for a, _ in rows) / len(rows)
            mean = sum(b for _, b in rows) / len(rows)
            print(f"{fmt:6s} {name:30s} KL first {first:.4f} mean {mean:.4f} | "
                  + " ".join(f"{a:.4f}/{b:.4f}" for a, b in rows), flush=True)
    kv_quant.position0_nearest = default_rule
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
