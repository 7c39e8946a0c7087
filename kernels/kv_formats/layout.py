"""Paged KV layout shared by every format and both backends.

One attention layer's cache is ONE ``uint8`` tensor ``[num_pages, 2, num_kv_heads,
head_page_bytes]`` (index 1: 0 = K, 1 = V), so a page of a layer is one contiguous byte
range (``2 * num_kv_heads * head_page_bytes``) that the KV daemon can move without knowing
the format. Inside one (page, K|V, head) block of ``head_page_bytes`` bytes:

    [ codes: page_size rows x code_bytes(d) ][ scales: page_size rows x scale_bytes(d) ]

row ``i`` being the token at position ``page_index * page_size + i`` of its sequence.
Per-format row encodings are documented in ``bf16``/``fp8``/``int8``/``nvfp4``.

One exception to the row order (since ``PAGE_LAYOUT_VERSION`` 2): nvfp4's V scale region is
block-major. Block ``b``'s 64 scale bytes lie together, token ``i``'s at byte
``64 b + scale_slot(i)`` of the region, ``scale_slot(i) = 16 ((i >> 1) & 3) + (i & 1) +
2 (i >> 3)``: the sixteen tokens whose V values one thread of the Hopper decode holds in the
tensor-core operand (tokens ``i`` with the same bits 1-2) are sixteen consecutive bytes, one
16-byte shared-memory load per block instead of sixteen single bytes
(``paged_attention.gluon_decode``). K's scales (read with K's rows) stay row-major.

K's rows are stored in the basis ``KVLayout.rotate`` gives: Hadamard-rotated as a whole
(``hadamard``), per 16-element block (``hadamard_block`` 16: ``I (x) H_16``), or as they are;
queries are rotated alike before QK (``hadamard_size`` names the transform).

Global scales of a layer: fp32 ``[2, num_kv_heads]`` (K row, V row), each a power of two
(``1.0`` for formats that ignore them). A slot is ``page_id * page_size + offset``;
slot ``-1`` means "skip this token" (padding).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from types import ModuleType

import torch

from deepwell.kernels.hadamard.reference import fwht
from deepwell.kernels.kv_formats import bf16, fp8, int8, nvfp4

PAGE_SIZE = 64
HEAD_DIMS = (64, 128, 256)
# bumped whenever the bytes of a page change meaning (part of the calibration digest, which
# names what cached pages mean): 2 = nvfp4 V block scales block-major (module doc); 3 = nvfp4
# code bytes with the low element's sign at bit 7 and index at bits 1-3 (``nvfp4`` module doc)
PAGE_LAYOUT_VERSION = 3
HADAMARD_BLOCKS = (0, 16)  # KVLayout.hadamard_block: 0 = the whole head's transform


def scale_slot(i):
    """Byte of token row ``i`` (int or integer tensor, 0..63) within one block's 64 scale
    bytes of a block-major scale region (module doc)."""
    return 16 * ((i >> 1) & 3) + (i & 1) + 2 * (i >> 3)


class KVFormat(str, enum.Enum):
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    NVFP4 = "nvfp4"


CODECS: dict[KVFormat, ModuleType] = {
    KVFormat.BF16: bf16,
    KVFormat.FP8: fp8,
    KVFormat.INT8: int8,
    KVFormat.NVFP4: nvfp4,
}


def default_hadamard(fmt: KVFormat) -> bool:
    """Hadamard on K by default where it helps (docs/kernels.md, SmolLM2 perplexity): nvfp4
    (+8.99% -> +5.62% over bf16) and fp8 (+1.33% -> +0.84%); int8's per-token scale is
    already within +0.05%."""
    return fmt in (KVFormat.NVFP4, KVFormat.FP8)


@dataclass(frozen=True)
class KVLayout:
    """Shape of one attention layer's paged cache in a given format."""

    fmt: KVFormat = field(metadata={"help": "KV format: bf16, fp8, int8 or nvfp4"})
    num_kv_heads: int = field(metadata={"help": "KV heads of the layer"})
    head_dim: int = field(metadata={"help": "head dimension (64, 128 or 256)"})
    hadamard: bool = field(default=True, metadata={"help": "rotate K (and Q) by a Hadamard transform"})
    page_size: int = field(default=PAGE_SIZE, metadata={"help": "tokens per page"})
    hadamard_block: int = field(default=0, metadata={
        "help": "with hadamard: 0 = one transform of the whole head, 16 = one per 16-element block"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", KVFormat(self.fmt))
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"invalid head_dim={self.head_dim}: must be one of {HEAD_DIMS}")
        if self.num_kv_heads < 1:
            raise ValueError(f"invalid num_kv_heads={self.num_kv_heads}: must be >= 1")
        if self.page_size != PAGE_SIZE:
            raise ValueError(f"invalid page_size={self.page_size}: kernels are built for {PAGE_SIZE}")
        if self.hadamard_block not in HADAMARD_BLOCKS or (self.hadamard_block and not self.hadamard):
            raise ValueError(f"invalid hadamard_block={self.hadamard_block}: must be one of {HADAMARD_BLOCKS}, "
                             "and 0 without hadamard")

    @classmethod
    def make(cls, fmt: str | KVFormat, num_kv_heads: int, head_dim: int, hadamard: bool | int | None = None) -> KVLayout:
        """``hadamard``: None = the format's default, True / False, or a rotation size: 0 (none),
        ``head_dim`` (the whole head) or 16 (each 16-element block, ``hadamard_block``)."""
        f = KVFormat(fmt)
        if hadamard is None:
            return cls(f, num_kv_heads, head_dim, default_hadamard(f))
        if isinstance(hadamard, bool) or hadamard in (0, head_dim):
            return cls(f, num_kv_heads, head_dim, bool(hadamard))
        return cls(f, num_kv_heads, head_dim, True, hadamard_block=int(hadamard))

    @property
    def hadamard_size(self) -> int:
        """Size of K's Hadamard transform: ``head_dim``, ``hadamard_block``, or 0 (not rotated)."""
        return (self.hadamard_block or self.head_dim) if self.hadamard else 0

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., head_dim] in K's stored basis (fp32): the reference ``fwht`` of this
        layout's size, or ``x`` itself (as fp32) when K is not rotated."""
        return fwht(x, self.hadamard_size) if self.hadamard else x.to(torch.float32)

    @property
    def codec(self) -> ModuleType:
        return CODECS[self.fmt]

    @property
    def code_bytes(self) -> int:
        """Code bytes per token per head."""
        return self.codec.code_bytes(self.head_dim)

    @property
    def scale_bytes(self) -> int:
        """Scale bytes per token per head."""
        return self.codec.scale_bytes(self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes per token per head for K (and again for V)."""
        return self.code_bytes + self.scale_bytes

    @property
    def head_page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scale region inside a (page, K|V, head) block."""
        return self.page_size * self.code_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of this layer (K and V, all KV heads)."""
        return 2 * self.num_kv_heads * self.head_page_bytes

    def scales_by_block(self, kv: int) -> bool:
        """Is the scale region of K (0) / V (1) block-major (module doc)? nvfp4's V only."""
        return self.fmt is KVFormat.NVFP4 and kv == 1

    def scale_index(self, kv: int, rows: torch.Tensor) -> torch.Tensor:
        """Byte offsets [N, scale_bytes] within the scale region of the scale bytes of token
        rows ``rows`` [N] (0..page_size-1) of K (0) / V (1)."""
        blk = torch.arange(self.scale_bytes, device=rows.device)
        rows = rows.long()
        if self.scales_by_block(kv):
            return blk[None, :] * self.page_size + scale_slot(rows)[:, None]
        return rows[:, None] * self.scale_bytes + blk[None, :]

    def allocate(self, num_pages: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(num_pages, 2, self.num_kv_heads, self.head_page_bytes, dtype=torch.uint8, device=device)

    def check_cache(self, cache: torch.Tensor) -> None:
        want = (2, self.num_kv_heads, self.head_page_bytes)
        if cache.dtype != torch.uint8 or cache.dim() != 4 or tuple(cache.shape[1:]) != want:
            raise ValueError(f"cache must be uint8 [pages, {want[0]}, {want[1]}, {want[2]}], got {cache.dtype} {list(cache.shape)}")
        if not cache.is_contiguous():
            raise ValueError("cache must be contiguous")

    def default_scales(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.ones(2, self.num_kv_heads, dtype=torch.float32, device=device)


def check_global_scales(scales: torch.Tensor, layout: KVLayout) -> None:
    """Global scales must be fp32 [2, num_kv_heads], positive powers of two."""
    if scales.dtype != torch.float32 or tuple(scales.shape) != (2, layout.num_kv_heads):
        raise ValueError(f"global scales must be float32 [2, {layout.num_kv_heads}], got {scales.dtype} {list(scales.shape)}")
    mant, _ = torch.frexp(scales.detach().cpu())
    if not bool(((mant == 0.5) & (scales.detach().cpu() > 0)).all()):
        raise ValueError(f"global scales must be positive powers of two, got {scales.tolist()}")


def pow2_at_least(x: float) -> float:
    """Smallest power of two >= x (x > 0)."""
    return float(2.0 ** math.ceil(math.log2(x)))
