"""The memory side of the Gluon nvfp4 decode alone: the same ring of ``cp.async`` pages, no
unpacking or products (one byte per page is summed so nothing is dead), printed as a fraction
of the H200's 4.8 TB/s for split counts and ring depths — the roofline the decode kernel's
loop can approach (docs/kernels.md). Needs an sm_90 GPU and a Triton with Gluon.

    python3 benchmarks/kv_page_ring.py
"""
import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from benchmarks.kv_attention import HKV, D, bench_graph, decode_case  # noqa: E402
from deepwell.kernels.paged_attention import gluon_decode as gd  # noqa: E402


@gluon.jit
def copy_kernel(out_ptr, cache_ptr, bt_ptr, ctx_ptr, stride_cp, stride_ckv, stride_ch, stride_bt,
                D: gl.constexpr, SCALE_OFF: gl.constexpr, NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr):
    CB: gl.constexpr = D // 2
    SB: gl.constexpr = D // 16
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    kc_lay: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=128 // CB, max_phase=CB // 16, order=[1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    kc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, CB], kc_lay)
    ks_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, SB], plain)
    vc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, CB], plain)
    vs_s = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, SB], plain)
    ctx = gl.load(ctx_ptr + b)
    p_begin, n = gd._split_pages(ctx, split, NUM_SPLITS)
    for i in gl.static_range(STAGES - 1):
        if i < n:
            gd._issue_page(cache_ptr, bt_ptr, b, p_begin + i, i, kc_s, ks_s, vc_s, vs_s,
                           stride_bt, stride_cp, stride_ckv, stride_ch, kvh, CB, SB, SCALE_OFF)
        async_copy.commit_group()
    lay: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    acc = gl.zeros([32, 16], gl.int32, layout=lay)
    for i in range(0, n):
        nxt = i + STAGES - 1
        if nxt < n:
            gd._issue_page(cache_ptr, bt_ptr, b, p_begin + nxt, nxt % STAGES, kc_s, ks_s, vc_s, vs_s,
                           stride_bt, stride_cp, stride_ckv, stride_ch, kvh, CB, SB, SCALE_OFF)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        acc += vc_s.index(i % STAGES).slice(0, 32, dim=0).slice(0, 16, dim=1).load(lay).to(gl.int32)
        gl.thread_barrier()
    async_copy.wait_group(0)
    gl.store(out_ptr + (b * gl.num_programs(1) + kvh) * NUM_SPLITS + split, gl.sum(gl.sum(acc, axis=1), axis=0))


def main() -> int:
    if not (torch.cuda.is_available() and gd.available(torch.device("cuda"))):
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    for batch, ctx in [(8, 131072), (64, 16384), (1, 131072)]:
        layout, cache, tables, ctx_lens, q = decode_case("nvfp4", batch, ctx, 1)
        for splits in (8, 2, 64):
            for stages in (2, 3, 4):
                out = torch.empty(batch * HKV * splits, dtype=torch.int32, device="cuda")
                def run(out=out, cache=cache, splits=splits, stages=stages):
                    copy_kernel[(batch, HKV, splits)](out, cache, tables, ctx_lens, cache.stride(0), cache.stride(1),
                                                      cache.stride(2), tables.stride(0), D=D, SCALE_OFF=layout.scale_offset,
                                                      NUM_SPLITS=splits, STAGES=stages, num_warps=4)
                sec = bench_graph(run)
                nbytes = batch * ctx * HKV * 2 * layout.token_bytes
                print(f"copy B={batch} ctx={ctx} splits={splits} stages={stages} {sec*1e6:8.1f} us {nbytes/sec/4.8e12:6.1%}", flush=True)
        del cache, run  # the next case's cache is allocated without this one
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
