"""Time the fused ops against their torch references on a CUDA device (Qwen3.5-27B sizes).

    python -m deepwell.kernels.fused.bench [--tokens 1 64 4096]

Prints, per op and token count, the fused kernel's and the reference's time (µs, CUDA events
through ``triton.testing.do_bench``, median) and the fused kernel's bandwidth (GB/s: the bytes
it must read and write once, over its time).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from triton.testing import do_bench

from deepwell.kernels.fused import activation, gdn, norm, references as ref, rotary


Case = tuple[str, Callable[[], object], Callable[[], object], int]


def _cases(t: int, dev: str = "cuda") -> list[Case]:
    """(name, fused call, torch reference call, bytes the op must move) at ``t`` tokens."""
    bf = torch.bfloat16
    x, h = torch.randn(t, 5120, device=dev, dtype=bf), torch.randn(t, 5120, device=dev, dtype=bf)
    w = torch.randn(5120, device=dev, dtype=bf) * 0.1
    q, gate = torch.randn(t, 24, 512, device=dev, dtype=bf).chunk(2, dim=-1)
    qn, kn = torch.randn(t, 24, 256, device=dev, dtype=bf), torch.randn(t, 4, 256, device=dev, dtype=bf)
    wq = torch.randn(256, device=dev, dtype=bf) * 0.1
    ang = torch.rand(t, 64, device=dev) * 6  # unit rotations: in-place repeats stay finite
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    o = torch.randn(t, 24 * 256, device=dev, dtype=bf)
    gu = torch.randn(t, 2 * 17408, device=dev, dtype=bf)
    core, z = torch.randn(t, 48, 128, device=dev), torch.randn(t, 48, 128, device=dev, dtype=bf)
    wv = torch.randn(128, device=dev, dtype=bf) * 0.1
    ba = torch.randn(t, 96, device=dev, dtype=bf)
    alog, dtb = torch.randn(48, device=dev, dtype=bf), torch.randn(48, device=dev, dtype=bf)
    e = 2  # bytes per bf16 element
    return [
        ("rms_norm 5120", lambda: norm.rms_norm(x, w, 1e-6, True), lambda: ref.rms_norm(x, w, 1e-6, True),
         2 * t * 5120 * e),
        ("add_rms_norm 5120", lambda: norm.add_rms_norm(x, h, w, 1e-6, True),
         lambda: ref.add_rms_norm(x, h, w, 1e-6, True), 4 * t * 5120 * e),
        ("q_norm 24x256", lambda: norm.rms_norm(q, wq, 1e-6, True), lambda: ref.rms_norm(q, wq, 1e-6, True),
         2 * t * 24 * 256 * e),
        ("rope q+k in place", lambda: rotary.rope(qn, kn, cos, sin, inplace=True), lambda: ref.rope(qn, kn, cos, sin),
         2 * t * 28 * 64 * e + 2 * t * 64 * e),
        ("attn gate 24x256", lambda: activation.sigmoid_gate_mul(o, gate),
         lambda: o * torch.sigmoid(gate.reshape(t, -1)), 3 * t * 24 * 256 * e),
        ("silu_and_mul 17408", lambda: activation.silu_and_mul(gu), lambda: ref.silu_and_mul(gu),
         3 * t * 17408 * e),
        ("gdn gated norm+cast", lambda: norm.gated_rms_norm(core, z, wv, 1e-6, bf),
         lambda: ref.gated_rms_norm(core.to(bf), z, wv, 1e-6), t * 48 * 128 * (4 + 2 * e)),
        ("gdn gating 48", lambda: gdn.gdn_gating(ba[:, 48:], ba[:, :48], alog, dtb),
         lambda: ref.gdn_gating(ba[:, 48:], ba[:, :48], alog, dtb), t * 48 * (2 * e + 4 + e)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    print(f"{'op':<22}{'tokens':>7}{'fused us':>10}{'torch us':>10}{'GB/s':>8}")
    for t in args.tokens:
        for name, fused, torch_ref, nbytes in _cases(t):
            tf = do_bench(fused, warmup=25, rep=100, return_mode="median") * 1e3
            tr = do_bench(torch_ref, warmup=25, rep=100, return_mode="median") * 1e3
            print(f"{name:<22}{t:>7}{tf:>10.2f}{tr:>10.2f}{nbytes / tf / 1e3:>8.0f}")


if __name__ == "__main__":
    main()
