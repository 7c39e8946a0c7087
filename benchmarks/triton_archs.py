"""Offline build of every Triton kernel the KV backend launches, for several NVIDIA GPU
architectures — no GPU needed (Triton's bundled ``ptxas``).

    python benchmarks/triton_archs.py [--arch 80 86 89 90 100 103 120] [--quick]

The backend (``kernels.backend.TritonBackend``) runs a few small appends, decodes (T = 1 and
4), prefills (packed pages and the fp16 workspace) and page-centered calls per format on CPU
tensors with ``JITFunction.run`` replaced by a recorder: every launch's arguments and
constexprs are captured exactly as the launcher chose them, nothing runs. Each distinct launch
is then compiled with ``triton.compile`` for each architecture (the constexprs ``FP8_HW`` and
``UNPACK_ASM`` as the launchers would set them there: ``kernels.e4m3_unpack.fp8_conversion_for``,
``paged_attention.triton_kernel.unpack_asm_for``), and its shared memory checked against what
a block of that architecture may use (``SHARED_LIMIT``: over it, Triton refuses the launch).
Prints one line per launch and architecture; exit status 1 if any fails. ``--quick``: head_dim 64 only (the test suite's
check, ``tests/kernels/test_archs.py``). The Gluon kernels (Hopper only) have their own offline
build, ``benchmarks/gluon_sass.py``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # launches as on a GPU (captured, not run): before triton loads
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from deepwell.kernels.e4m3_unpack import fp8_conversion_for  # noqa: E402
from deepwell.kernels.paged_attention.triton_kernel import unpack_asm_for  # noqa: E402

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
           torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")
_LAUNCH_ONLY = ("num_ctas", "launch_pdl", "launch_cooperative_grid")
# the most shared memory a block may opt into, per architecture (CUDA programming guide; A100 /
# A800 for 8.0, RTX 30 / A10 / A40 for 8.6, Ada for 8.9, H100 / H200, B200 / GB300, RTX 50)
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
                120: 101376}


def capture(quick: bool) -> list[tuple[JITFunction, tuple, dict]]:
    """The distinct Triton launches of a set of backend calls (module doc)."""
    from deepwell.kernels.backend import KVCacheLayer, TritonBackend
    from deepwell.kernels.kv_formats.layout import KVLayout
    from deepwell.kernels.page_center import PageCenter, rope_table

    launches: list[tuple[JITFunction, tuple, dict]] = []

    def record(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> None:
        launches.append((self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record  # type: ignore[method-assign]
    try:
        be = TritonBackend()
        g = torch.Generator().manual_seed(0)
        n = 130
        for fmt in ("nvfp4", "fp8", "int8"):
            for d in (64,) if quick else (64, 128, 256):
                layout = KVLayout.make(fmt, 2, d, True)
                layer = KVCacheLayer.allocate(layout, 4)
                be.append(layer, torch.randn(n, 2, d, generator=g), torch.randn(n, 2, d, generator=g), torch.arange(n))
                q = torch.randn(n, 6, d, generator=g)
                wide = torch.randn(n, 24, d, generator=g)  # 12 query heads per KV head: the workspace path
                tab, lens = torch.arange(3, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32)
                centers = [None]
                if fmt != "int8":
                    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
                    centers.append(PageCenter(torch.randn(2, d, generator=g), rope_table(inv, 8)))
                for pc in centers:
                    layer.page_center = pc
                    be.decode_attention(q[-1:], layer, tab, lens, sm_scale=0.1)
                    be.decode_attention(q[-4:], layer, tab, lens, tokens_per_seq=4, sm_scale=0.1)
                    be.prefill_attention(q[-16:], layer, tab, lens, [16], sm_scale=0.1)
                    be.prefill_attention(wide, layer, tab, lens, [n], sm_scale=0.1)
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    distinct: dict[tuple, tuple[JITFunction, tuple, dict]] = {}
    for fn, args, kwargs in launches:
        key = (fn.fn.__name__, tuple(sorted((k, str(v)) for k, v in kwargs.items())),
               tuple(_type_of(a) for a in args))
        distinct.setdefault(key, (fn, args, kwargs))
    return list(distinct.values())


def _type_of(v: object) -> str:
    if v is None:
        return "constexpr"
    if isinstance(v, torch.Tensor):
        return "*" + _DTYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"cannot type a launch argument of {type(v).__name__}")


def build(fn: JITFunction, args: tuple, kwargs: dict, arch: int) -> int:
    """Compile one captured launch for ``sm_{arch}``; its shared memory in bytes (raises what
    Triton raises)."""
    params = inspect.signature(fn.fn).parameters
    values = dict(zip(params, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k not in _OPTIONS + _LAUNCH_ONLY})
    for name, p in params.items():
        if name not in values and p.default is not inspect.Parameter.empty:
            values[name] = p.default
    cap = (arch // 10, arch % 10)  # as the launchers decide on a GPU of this architecture
    if "FP8_HW" in params:
        values["FP8_HW"] = fp8_conversion_for(cap)
    if "UNPACK_ASM" in params:
        values["UNPACK_ASM"] = bool(values["UNPACK_ASM"]) and unpack_asm_for(cap)
    signature, constexprs = {}, {}
    for name, p in params.items():
        v = values[name]
        if "constexpr" in str(p.annotation) or v is None:
            signature[name], constexprs[name] = "constexpr", v
        else:
            signature[name] = _type_of(v)
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    return int(compiled.metadata.shared)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 86, 89, 90, 100, 103, 120],
                    help="compute capabilities, e.g. 80 90")
    ap.add_argument("--quick", action="store_true", help="head_dim 64 only")
    args = ap.parse_args(argv)
    launches = capture(args.quick)
    print(f"triton {triton.__version__}: {len(launches)} distinct launches")
    failed = 0
    for fn, a, kw in launches:
        what = fn.fn.__name__ + "".join(f" {k}={kw[k]}" for k in ("FMT", "D", "BLOCK_M", "UNIFORM_T") if k in kw)
        for arch in args.arch:
            try:
                shared = build(fn, a, kw, arch)
                limit = SHARED_LIMIT.get(arch)
                if limit is not None and shared > limit:  # Triton refuses the launch on such a GPU
                    failed += 1
                    result = f"FAIL {shared} bytes of shared memory, the GPU has {limit} per block"
                else:
                    result = f"ok ({shared // 1024} KB shared)"
            except Exception as exc:  # report every failure, not just the first
                failed += 1
                lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
                result = "FAIL " + (lines[-1] if lines else type(exc).__name__)[:200]
            print(f"sm_{arch} {what}: {result}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
