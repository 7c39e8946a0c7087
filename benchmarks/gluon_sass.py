"""Offline sm_90 build of the Gluon kernels: registers, spills, shared memory, instruction counts (no GPU).

    python benchmarks/gluon_sass.py decode --t 4             # the nvfp4 verify kernel, 27B layout
    python benchmarks/gluon_sass.py decode --t 4 --maxnreg 168 --sass t4.sass
    python benchmarks/gluon_sass.py append --fmt nvfp4 --feedback --warps 4 [--hadamard-size 16]
    python benchmarks/gluon_sass.py decode --t 1 --module base_gluon_decode.py   # another version

Registers per thread decide how many programs share an SM (``gluon_decode.programs_per_sm``),
and spills inside the page loop are what made every register-capped variant slower
(docs/kernels.md), so a kernel change can be screened here for free before it is timed on a
GPU. The kernel is compiled exactly as the backend launches it (constexprs, ``maxnreg``,
``enable_fp_fusion``, 16-byte divisibility of pointers and strides) for an sm_90 target, and
ptxas's resource line is printed with the static SASS instruction count: the whole kernel and,
for each loop (a backward branch), the instructions inside it, with ``--ops`` the most common
opcodes there. The numbers are the GPU's only for the Triton version the device runs (3.6:
Gluon's API differs between versions; 3.9 has no ``async_copy_global_to_shared``). Without a
CUDA GPU the CPU machine's Triton may be another version; a copy of the device's goes beside it:

    pip download --no-deps triton==3.6.0 -d /tmp/t36w && pip install --no-deps --target /tmp/t36 /tmp/t36w/*.whl
    PYTHONPATH=/tmp/t36 python benchmarks/gluon_sass.py decode --t 4
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from types import ModuleType

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from deepwell.kernels.kv_formats import nvfp4  # noqa: E402
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout  # noqa: E402

DEVICE_TRITON = "3.6"
_FMT_CODE = {"nvfp4": 0, "fp8": 1, "int8": 2}
_POINTER_TYPES = {
    "decode": {"q_ptr": "*bf16", "out_ptr": "*bf16", "opart_ptr": "*fp32", "lse_ptr": "*fp32", "cache_ptr": "*u8",
               "gscale_ptr": "*fp32", "bt_ptr": "*i32", "ctx_ptr": "*i32", "perm_ptr": "*i32", "bias_ptr": "*fp32",
               "oacc_ptr": "*fp32"},  # (a pointer parameter of versions that flush their sums to global memory)
    "append": {"cache_ptr": "*u8", "k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i64", "g_ptr": "*fp32",
               "koff_ptr": "*fp32", "cnt_ptr": "*i64", "fb_ptr": "*fp32"},
}
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)[^;]*;", re.M)
_BRANCH = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`?\()?.*?0x([0-9a-f]+)", re.M)


def load_module(path: str | None, default: str) -> ModuleType:
    """The kernel module: the repository's, or another version of it from a file."""
    if path is None:
        return importlib.import_module(default)
    spec = importlib.util.spec_from_file_location("gluon_sass_module", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path} as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def decode_build(mod: ModuleType, args: argparse.Namespace) -> tuple[object, dict, dict]:
    """(kernel, constexprs, options) of ``gluon_decode.paged_decode``'s launch for the shape."""
    fmt = KVFormat(args.fmt)
    layout = KVLayout.make(args.fmt, 4, args.d)
    n = mod.num_columns(args.t, args.group)
    v_regs, flush = mod.kernel_config(args.t, args.group, args.d, fmt)
    const = dict(D=args.d, G=args.group, SCALE_OFF=layout.scale_offset, NUM_SPLITS=args.splits, STAGES=2,
                 P_SHIFT=2.0 ** (mod.P_LOG2_INT8 if fmt is KVFormat.INT8 else mod.P_LOG2), T=args.t, N=n,
                 V_REGS=v_regs, FLUSH=flush, PDL=True, FMT=_FMT_CODE[args.fmt], PC=args.page_terms)
    maxnreg = args.maxnreg or mod.max_registers(n, v_regs, flush)
    return mod.decode_kernel, const, {"num_warps": 4, **({"maxnreg": maxnreg} if maxnreg else {})}


def append_build(mod: ModuleType, args: argparse.Namespace) -> tuple[object, dict, dict]:
    """(kernel, constexprs, options) of ``gluon_append.launch`` (K offset, counts, rotation)."""
    layout = KVLayout.make(args.fmt, 4, args.d)
    hs = args.hadamard_size or args.d
    const = dict(D=args.d, HSCALE=hs ** -0.5, HADAMARD=True, HAS_OFFSET=True, COUNT=True, FEEDBACK=args.feedback,
                 SCALE_OFF=layout.scale_offset, SEARCH_DOWN=nvfp4.SEARCH_DOWN, SEARCH_UP=nvfp4.SEARCH_UP,
                 UP_SPAN=nvfp4.UP_SPAN, ERR_BITS=nvfp4.ERR_BITS, ERR_EXP_FLOOR=nvfp4.ERR_EXP_FLOOR, PDL=True,
                 FP8=args.fmt == "fp8")
    if "FB_DOWN" in inspect.signature(mod.append_kernel.fn).parameters:  # K feedback's own list (since 2026-12-04)
        const.update(FB_DOWN=nvfp4.FEEDBACK_DOWN, FB_LO=nvfp4.FEEDBACK_FOUR_LO, FB_HI=nvfp4.FEEDBACK_FOUR_HI)
    if args.hadamard_size:  # K's Hadamard transform per block of this size (since 2026-12-05)
        const.update(HSIZE=args.hadamard_size)
    opts = {"num_warps": args.warps, "enable_fp_fusion": not args.feedback}
    if args.maxnreg:
        opts["maxnreg"] = args.maxnreg
    return mod.append_kernel, const, opts


def compile_cubin(kernel: object, which: str, const: dict, opts: dict) -> tuple[bytes, int]:
    """(cubin, shared memory bytes) of ``kernel`` for sm_90."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig_params = inspect.signature(kernel.fn).parameters
    params = list(sig_params)
    const = dict(const)
    for name, p in sig_params.items():  # constexprs left at their defaults (another version's own switches)
        if name not in const and p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation):
            const[name] = p.default
    unknown = set(const) - set(params)
    if unknown:
        raise SystemExit(f"the kernel has no parameters {sorted(unknown)}: is --module another version?")
    ptrs = _POINTER_TYPES[which]
    sig = {p: "constexpr" if p in const else ptrs.get(p, "fp32" if p == "qk_scale" else "i32") for p in params}
    aligned = [i for i, p in enumerate(params) if p in ptrs or (p.startswith("stride") and p != "stride_on")
               or p in ("H", "W_BIAS")]
    src = GluonASTSource(kernel, sig, constexprs=const, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return compiled.asm["cubin"], compiled.metadata.shared


def cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[tuple[int, int]]:
    """(start, end) addresses of each backward branch's loop, in program order."""
    out = []
    for m in _BRANCH.finditer(sass):
        at, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < at:
            out.append((target, at))
    return sorted(out)


def report(cubin: bytes, shared: int, ops: int, sass_path: str | None) -> None:
    usage = [ln.strip() for ln in cuobjdump(cubin, "--dump-resource-usage").splitlines() if "REG:" in ln]
    print(usage[0] if usage else "no resource line from cuobjdump")
    print(f"shared memory {shared} bytes (the launch's; sm_90 holds 227 KB per SM)")
    sass = cuobjdump(cubin, "-sass")
    if sass_path:
        with open(sass_path, "w") as f:
            f.write(sass)
    instrs = [(int(a, 16), op) for a, op in _INSTR.findall(sass)]
    print(f"static instructions {len(instrs)}")
    for start, end in loops(sass):
        inside = Counter(op for a, op in instrs if start <= a <= end)
        spills = inside["LDL"] + inside["STL"]
        line = f"loop {start:#07x}-{end:#07x}: {sum(inside.values())} instructions, {spills} local loads/stores"
        if ops:
            line += " | " + " ".join(f"{op} {c}" for op, c in inside.most_common(ops))
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=("decode", "append"),
                    help="gluon_decode.decode_kernel or gluon_append.append_kernel")
    ap.add_argument("--module", default=None, help="a file holding another version of the kernel's module")
    ap.add_argument("--fmt", default="nvfp4", choices=sorted(_FMT_CODE), help="KV format (append: nvfp4 or fp8)")
    ap.add_argument("--d", type=int, default=256, help="head_dim")
    ap.add_argument("--t", type=int, default=1, help="decode: query tokens per sequence (verify: T > 1)")
    ap.add_argument("--group", type=int, default=6, help="decode: query heads per KV head (27B: 6)")
    ap.add_argument("--splits", type=int, default=8, help="decode: split count (a constexpr)")
    ap.add_argument("--page-terms", action="store_true", help="decode: with the per-page K terms (page_bias)")
    ap.add_argument("--feedback", action="store_true", help="append: K with query-weighted rounding")
    ap.add_argument("--warps", type=int, default=1, help="append: warps per program")
    ap.add_argument("--hadamard-size", type=int, default=0, help="append: K's Hadamard size (16: per block; 0: d)")
    ap.add_argument("--maxnreg", type=int, default=0, help="register cap (default: what the backend passes)")
    ap.add_argument("--ops", type=int, default=0, help="show this many of each loop's most common opcodes")
    ap.add_argument("--sass", default=None, help="write the SASS listing here")
    args = ap.parse_args()
    if not triton.__version__.startswith(DEVICE_TRITON):
        print(f"note: triton {triton.__version__} here, {DEVICE_TRITON} on the device (see --help)", file=sys.stderr)
    if args.kernel == "append" and args.fmt not in ("nvfp4", "fp8"):
        ap.error("the Gluon append covers nvfp4 and fp8")
    if args.d not in (64, 128, 256) or (args.kernel == "decode" and args.d == 64):
        ap.error("--d must be 128 or 256 (decode), 64, 128 or 256 (append)")
    if args.t < 1 or args.group < 1 or args.splits < 1 or args.warps < 1 or args.maxnreg < 0:
        ap.error("--t, --group, --splits and --warps must be >= 1, --maxnreg >= 0")
    if args.kernel == "decode":
        mod = load_module(args.module, "deepwell.kernels.paged_attention.gluon_decode")
        if args.t * args.group > mod.MAX_COLS:
            ap.error(f"--t x --group must be <= {mod.MAX_COLS}")
        kernel, const, opts = decode_build(mod, args)
    else:
        mod = load_module(args.module, "deepwell.kernels.kv_append.gluon_append")
        kernel, const, opts = append_build(mod, args)
    if args.kernel == "decode":
        shape = f"T={args.t} group={args.group} splits={args.splits}"
    else:
        shape = f"feedback={args.feedback} warps={args.warps}"
    print(f"{args.kernel} {args.fmt} d={args.d} {shape} " + " ".join(f"{k}={v}" for k, v in opts.items()))
    try:
        cubin, shared = compile_cubin(kernel, args.kernel, const, opts)
    except Exception as exc:  # a Gluon API this Triton lacks, or a kernel that does not build
        while exc.__cause__ is not None:  # the root of the compiler's chained errors says what failed
            exc = exc.__cause__
        hint = "" if triton.__version__.startswith(DEVICE_TRITON) else f" (triton {triton.__version__}: see --help)"
        print(f"the kernel did not compile{hint}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    report(cubin, shared, args.ops, args.sass)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
