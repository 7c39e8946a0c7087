"""``reference.dequantize`` as one Triton launch (bit-identical workspace bytes).

Grid ``[B * W, Hkv, 2]``: a program unpacks one (page, K|V, head) block of 64 rows. An
nvfp4 element becomes the fp16 pattern ``sign << 15 | index << 9`` (its E2M1 value times
``2**-14``, page layout 3: low element sign bit 7 and index bits 1-3, high element index bits
4-6 and sign bit 0) times its E4M3 block scale in fp16 (exact), as in the attention kernels;
an fp8 byte its E4M3 value (``kernels.e4m3_unpack``: the hardware's conversion from sm_89, integer
operations before) times ``2**-14`` (exact); an int8 code its
value times its token's fp32 scale, rounded to fp16 (``reference.value_shift``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepwell.kernels.e4m3_unpack import e4m3_f16, has_fp8_conversion
from deepwell.kernels.kv_dequant import reference
from deepwell.kernels.kv_formats.layout import KVFormat, KVLayout

VALUE_SHIFT = tl.constexpr(reference.VALUE_SHIFT)


@triton.jit
def dequant_kernel(cache_ptr, ws_ptr, bt_ptr, ctx_ptr, center_ptr, W,
                   stride_cp, stride_ckv, stride_ch, stride_wp, stride_wkv, stride_wh,
                   D: tl.constexpr, SCALE_OFF: tl.constexpr, PAGE: tl.constexpr, FMT: tl.constexpr,
                   CENTER: tl.constexpr = False, FP8_HW: tl.constexpr = True, scale_ptr=None,
                   OUT_SCALE: tl.constexpr = False):
    wp = tl.program_id(0)
    hd = tl.program_id(1)
    kv = tl.program_id(2)
    b = wp // W
    i = wp % W
    ctx = tl.load(ctx_ptr + b)
    if i * PAGE < ctx:
        if FMT != 0:  # fp8 (1) / int8 (2): one code byte per element
            page = tl.load(bt_ptr + wp).to(tl.int64)
            base = cache_ptr + page * stride_cp + kv * stride_ckv + hd * stride_ch
            r = tl.arange(0, PAGE)
            c = tl.arange(0, D)
            code = tl.load(base + r[:, None] * D + c[None, :])
            out = ws_ptr + wp.to(tl.int64) * stride_wp + kv * stride_wkv + hd * stride_wh + r[:, None] * D + c[None, :]
            if FMT == 1:
                val = (e4m3_f16(code, FP8_HW).to(tl.float32) * VALUE_SHIFT).to(tl.float16)
            else:
                s = tl.load((base + SCALE_OFF).to(tl.pointer_type(tl.float32)) + r)
                val = (code.to(tl.int8, bitcast=True).to(tl.float32) * s[:, None]).to(tl.float16)
            if CENTER:  # K centered per page: the page's offset added in fp32 to the fp16 value (V as it is)
                cv = tl.load(center_ptr + (i * tl.num_programs(1) + hd) * D + c)
                val = tl.where(kv == 0, (val.to(tl.float32) + cv[None, :]).to(tl.float16), val)
            if OUT_SCALE:  # dense K / V: the dequantized value (``reference.dense_scales``)
                val = (val.to(tl.float32) * tl.load(scale_ptr + kv * tl.num_programs(1) + hd)).to(tl.float16)
            tl.store(out, val)
        else:
            HALF: tl.constexpr = D // 2
            NB: tl.constexpr = D // 32  # blocks per half
            page = tl.load(bt_ptr + wp).to(tl.int64)  # the table is contiguous [B, W]
            base = cache_ptr + page * stride_cp + kv * stride_ckv + hd * stride_ch
            r = tl.arange(0, PAGE)
            c = tl.arange(0, HALF)
            blk = tl.arange(0, NB)
            code = tl.load(base + r[:, None] * HALF + c[None, :]).to(tl.int32)
            if kv == 0:  # row-major scale bytes
                s_idx = r[:, None] * (2 * NB) + blk[None, :]
                s_step = NB
            else:  # block-major (kv_formats.layout.scale_slot)
                slot = 16 * ((r >> 1) & 3) + (r & 1) + 2 * (r >> 3)
                s_idx = blk[None, :] * PAGE + slot[:, None]
                s_step = NB * PAGE
            s_lo = e4m3_f16(tl.load(base + SCALE_OFF + s_idx), FP8_HW)
            s_hi = e4m3_f16(tl.load(base + SCALE_OFF + s_idx + s_step), FP8_HW)
            s_lo = tl.reshape(tl.broadcast_to(s_lo[:, :, None], [PAGE, NB, 16]), [PAGE, HALF])
            s_hi = tl.reshape(tl.broadcast_to(s_hi[:, :, None], [PAGE, NB, 16]), [PAGE, HALF])
            lo = ((code & 0x8E) << 8).to(tl.int16).to(tl.float16, bitcast=True) * s_lo
            hi = (((code & 0x70) << 5) | ((code & 1) << 15)).to(tl.int16).to(tl.float16, bitcast=True) * s_hi
            out = ws_ptr + wp.to(tl.int64) * stride_wp + kv * stride_wkv + hd * stride_wh + r[:, None] * D + c[None, :]
            if CENTER:  # K centered per page: the page's offset back in fp32, one fp16 rounding
                crow = center_ptr + (i * tl.num_programs(1) + hd) * D + c
                c_lo = tl.load(crow)
                c_hi = tl.load(crow + HALF)
                lo = tl.where(kv == 0, (lo.to(tl.float32) + c_lo[None, :]).to(tl.float16), lo)
                hi = tl.where(kv == 0, (hi.to(tl.float32) + c_hi[None, :]).to(tl.float16), hi)
            if OUT_SCALE:  # dense K / V: the dequantized value (``reference.dense_scales``)
                f = tl.load(scale_ptr + kv * tl.num_programs(1) + hd)
                lo = (lo.to(tl.float32) * f).to(tl.float16)
                hi = (hi.to(tl.float32) * f).to(tl.float16)
            tl.store(out, lo)
            tl.store(out + HALF, hi)


def dequantize(cache: torch.Tensor, layout: KVLayout, block_tables: torch.Tensor, context_lens: torch.Tensor,
               workspace: torch.Tensor, centers: torch.Tensor | None = None, *,
               fp8_hw: bool | None = None) -> torch.Tensor:
    """Same bytes as ``reference.dequantize`` (``centers`` included); returns ``workspace``.
    ``fp8_hw``: E4M3 bytes by the hardware's conversion (default where the device has one) or
    by integer operations (``kernels.e4m3_unpack``; the same bytes)."""
    reference.check(cache, layout, block_tables, context_lens, workspace)
    reference.check_centers(layout, block_tables, centers)
    if not block_tables.is_contiguous():
        raise ValueError("block_tables must be contiguous")
    b, w = block_tables.shape
    if b * w == 0:
        return workspace
    ws = workspace.view(torch.float16)
    dequant_kernel[(b * w, layout.num_kv_heads, 2)](
        cache, ws, block_tables, context_lens, ws if centers is None else centers, w,
        cache.stride(0), cache.stride(1), cache.stride(2), ws.stride(0), ws.stride(1), ws.stride(2),
        D=layout.head_dim, SCALE_OFF=layout.scale_offset, PAGE=layout.page_size,
        FMT={KVFormat.NVFP4: 0, KVFormat.FP8: 1, KVFormat.INT8: 2}[layout.fmt], CENTER=centers is not None,
        FP8_HW=has_fp8_conversion(cache.device) if fp8_hw is None else fp8_hw, num_warps=4,
    )
    return workspace


def dequantize_dense(cache: torch.Tensor, layout: KVLayout, block_table: torch.Tensor, context_len: torch.Tensor,
                     out: torch.Tensor, out_scales: torch.Tensor | None = None,
                     centers: torch.Tensor | None = None, *, fp8_hw: bool | None = None) -> torch.Tensor:
    """Same values as ``reference.dequantize_dense`` in one launch: the workspace kernel writing
    page ``i`` of head ``h`` to rows ``64 i ..`` of ``out[kv, h]`` (its page, K|V and head
    strides those of the dense tensor), each value scaled by ``out_scales`` before its store."""
    reference.check_dense(layout, block_table, context_len, out_scales, out)
    reference.check_centers(layout, block_table, centers)
    if layout.fmt not in reference.FORMATS:
        raise ValueError(f"only nvfp4, fp8 and int8 caches are dequantized, got {layout.fmt.value}")
    if not block_table.is_contiguous():
        raise ValueError("block_table must be contiguous")
    w, ps, d = block_table.shape[1], layout.page_size, layout.head_dim
    if w == 0:
        return out
    dequant_kernel[(w, layout.num_kv_heads, 2)](
        cache, out, block_table, context_len, out if centers is None else centers, w,
        cache.stride(0), cache.stride(1), cache.stride(2), ps * d, out.stride(0), out.stride(1),
        D=d, SCALE_OFF=layout.scale_offset, PAGE=ps,
        FMT={KVFormat.NVFP4: 0, KVFormat.FP8: 1, KVFormat.INT8: 2}[layout.fmt], CENTER=centers is not None,
        FP8_HW=has_fp8_conversion(cache.device) if fp8_hw is None else fp8_hw,
        scale_ptr=out if out_scales is None else out_scales, OUT_SCALE=out_scales is not None, num_warps=4,
    )
    return out
