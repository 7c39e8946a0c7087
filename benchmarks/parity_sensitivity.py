"""How much a tiny parity config's KL to HF fp32 moves under an equally valid bf16 rounding.

``tests/engine/test_parity_gpu.py`` bounds the mean KL(HF fp32 || ours) of bf16 runs at 1e-3.
Some tiny random configs are ill-conditioned: one rounding more or less in the Gated DeltaNet's
causal conv moves a position's KL by 5-10x. This script runs a config on CPU in bf16 with the
reference layer ops twice, the conv rounded twice (the reference: conv, then SiLU, in bf16) and
once (fp32 conv and SiLU, one rounding: fla's kernel on the GPU, the more exact of the two), with
the parity test's one-shot prefills, and prints the KL per position. A KL that moves this much
under the more exact arithmetic is the model's conditioning, not a bug in a kernel.

    python benchmarks/parity_sensitivity.py qwen3_5_linear qwen3_5_moe qwen3_5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import kernels  # noqa: F401  (the deepwell package alias, before the repo root goes on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from deepwell.engine_service.layers.backend import ReferenceBackend  # noqa: E402
from deepwell.engine_service.loading import open_model  # noqa: E402
from deepwell.engine_service.runner import build_runner  # noqa: E402
from tests.engine.helpers_models import TINY, hf_logits, prompt, run_chunks, save_tiny  # noqa: E402

PREFILLS = (16, 33, 50, 64)  # the parity test's one-shot prefills


def conv_one_rounding(self: ReferenceBackend, x: torch.Tensor, state: torch.Tensor,
                      weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference conv in fp32, SiLU included, rounded once to ``x.dtype`` (fla's arithmetic)."""
    km1 = state.shape[-1]
    full = torch.cat([state.float(), x.t().float()], dim=-1)
    y = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1), groups=x.shape[1]).squeeze(0)
    return F.silu(y).t().to(x.dtype), full[:, full.shape[-1] - km1:].to(state.dtype)


def kl_per_position(path: Path, ref32: torch.Tensor) -> list[float]:
    runner = build_runner(open_model(path), device="cpu", dtype=torch.bfloat16, page_size=16)
    runner.allocate(num_pages=12, num_state_slots=2)
    rows = []
    for n in PREFILLS:
        runner.reset_state(1)
        rows += run_chunks(runner, prompt(), [n], [7, 2, 9, 4, 0], slot=1)
    ours, want = torch.stack(rows).float(), ref32[[n - 1 for n in PREFILLS]]
    kl = F.kl_div(ours.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return kl.tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", choices=sorted(TINY), help="tiny parity configs (tests/engine/helpers_models)")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    reference = ReferenceBackend.causal_conv1d
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            path = Path(tmp) / name
            ref32 = hf_logits(save_tiny(name, path), prompt())
            for label, conv in (("conv rounded twice (reference)", reference),
                                ("conv rounded once (fla)      ", conv_one_rounding)):
                ReferenceBackend.causal_conv1d = conv  # type: ignore[method-assign]
                try:
                    kl = kl_per_position(path, ref32)
                finally:
                    ReferenceBackend.causal_conv1d = reference  # type: ignore[method-assign]
                print(f"{name:15s} {label}: KL at positions {[n - 1 for n in PREFILLS]} = "
                      f"{', '.join(f'{v:.1e}' for v in kl)}; mean {sum(kl) / len(kl):.2e}")


if __name__ == "__main__":
    main()
