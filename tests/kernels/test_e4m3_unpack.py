"""E4M3 bytes to fp16 in the Triton kernels (``kernels.e4m3_unpack``): the integer path that GPUs
without Triton's ``fp8e4nv`` type (compute capability below 8.9: A100, A10) take gives the
same values as the hardware's conversion — for every byte, and through the attention and
workspace kernels of fp8 (codes) and nvfp4 (block scales), bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from deepwell.kernels.backend import KVCacheLayer
from deepwell.kernels.e4m3_unpack import e4m3_f16, has_fp8_conversion
from deepwell.kernels.kv_dequant import reference as dq_ref
from deepwell.kernels.kv_dequant import triton_kernel as dq_tk
from deepwell.kernels.kv_formats import KVLayout
from deepwell.kernels.paged_attention import triton_kernel as attn_tk
from tests.kernels.helpers import build_case

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _convert_kernel(x_ptr, y_ptr, FP8_HW: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(y_ptr + offs, e4m3_f16(tl.load(x_ptr + offs), FP8_HW))


@pytest.mark.parametrize("hw", [True, False])
def test_every_e4m3_byte_converts_exactly(hw):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEV)
    out = torch.empty(256, dtype=torch.float16, device=DEV)
    _convert_kernel[(1,)](codes, out, FP8_HW=hw)
    want = codes.view(torch.float8_e4m3fn).to(torch.float32)
    finite = ~want.isnan()  # 0x7F / 0xFF: NaN, which no encoder writes
    assert int(finite.sum()) == 254
    assert torch.equal(out.float()[finite], want[finite])
    assert torch.equal(out[finite].view(torch.int16), want[finite].to(torch.float16).view(torch.int16))  # -0 too


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_attention_and_workspace_take_either_path_bit_for_bit(fmt):
    layout = KVLayout.make(fmt, 2, 64)
    case = build_case(layout, [130, 40], seed=5, device=DEV, magnitude=3.0)
    gen = torch.Generator().manual_seed(6)
    layer = KVCacheLayer(layout, case.cache, case.scales)
    tables, lens = case.block_tables, case.context_lens
    ws = [dq_ref.allocate(layout, tables).fill_(0) for _ in range(2)]
    for w, hw in zip(ws, (True, False), strict=True):
        dq_tk.dequantize(case.cache, layout, tables, lens, w, fp8_hw=hw)
    assert torch.equal(ws[0], ws[1]) and bool(ws[0].any())  # the decoded K and V: bit for bit
    # On a GPU with the fp8 conversion, fp8 V takes the kernel's other branch (the PTX conversion,
    # halves one after the other): each KV tile's P.V goes into a fresh fp32 tile and is then added
    # to the accumulator, where the integer path accumulates inside the dot. Same decoded values
    # (above), another rounding order: the outputs may differ by one fp32 rounding of the running
    # sum per KV tile (P sums to 1 after the final division), i.e. 2 ulp of max|V| per tile at most.
    # Everywhere else (nvfp4, the interpreter) the two paths run the same arithmetic: bit for bit.
    tiles = -(-int(lens.max()) // layout.page_size)  # a tile is one page or more
    eps = torch.finfo(torch.float32).eps
    atol = 2 * tiles * eps * float(ws[1].float().abs().max()) if fmt == "fp8" and DEV == "cuda" else 0.0
    for t in (1, 4):  # decode, and verify (its 32-row blocks read nvfp4 V one half at a time on a GPU)
        q = torch.randn(2 * t, 6, 64, generator=gen).to(DEV)
        outs = [attn_tk.paged_attention(q, layer.data, layout, layer.scales, tables, lens, None, None, 0.125,
                                        num_splits=2, uniform_t=t, fp8_hw=hw) for hw in (True, False)]
        assert bool(outs[0].abs().sum() > 0)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=atol)


def test_the_hardware_path_is_taken_where_triton_has_the_type():
    assert has_fp8_conversion(torch.device("cpu"))  # the interpreter has it
    if torch.cuda.is_available():
        assert has_fp8_conversion(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (8, 9))


def test_the_unpacking_ptx_is_skipped_where_triton_cannot_build_it():
    from deepwell.kernels.e4m3_unpack import fp8_conversion_for
    from deepwell.kernels.paged_attention.triton_kernel import unpack_asm_for

    assert [fp8_conversion_for(c) for c in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))] == [
        False, False, True, True, True, True]
    # datacenter Blackwell with Triton 3.6 (the device's): an LLVM error on the PTX blocks
    assert not unpack_asm_for((10, 0), "3.6.0") and not unpack_asm_for((10, 3), "3.8.1")
    assert unpack_asm_for((10, 0), "3.9.0") and unpack_asm_for((9, 0), "3.6.0") and unpack_asm_for((12, 0), "3.6.0")
    assert unpack_asm_for((8, 0), "3.6.0")
