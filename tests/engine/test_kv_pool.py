"""``kv.pool``'s byte movers over every pool kind: device copies and export / import through a
flat host buffer are bit-exact, identical for float and quantized pools, and refuse bad ids."""

from __future__ import annotations

import pytest
import torch

from deepwell.engine_service.kv.float_pool import KVLayout as FloatLayout
from deepwell.engine_service.kv.float_pool import KVPool
from deepwell.engine_service.kv.pool import copy_rows, export_rows, import_rows, row_nbytes
from deepwell.engine_service.kv.quant_pool import QuantKVPool, quant_layout
from deepwell.engine_service.kv.state import StateLayout, StatePool

CPU = torch.device("cpu")


def _fill(tensors: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g, dtype=torch.uint8)
        t.view(-1).view(torch.uint8).copy_(raw)


def _pools() -> dict[str, list[torch.Tensor]]:
    flt = KVPool(FloatLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16), 9, CPU)
    quant = QuantKVPool(quant_layout("nvfp4", 2, 64, 64, "on"), 2, 9, CPU)
    state = StatePool(StateLayout(num_layers=2, conv_dim=6, conv_width=3, num_v_heads=2, head_k_dim=4, head_v_dim=4,
                                  conv_dtype=torch.float32), 9, CPU)
    return {"float": flt.page_tensors(), "nvfp4": quant.page_tensors(), "state": state.slot_tensors()}


@pytest.mark.parametrize("kind", ["float", "nvfp4", "state"])
def test_export_import_round_trip_is_bit_exact(kind: str) -> None:
    src, dst = _pools()[kind], _pools()[kind]
    _fill(src, 1)
    _fill(dst, 2)
    buf = torch.empty(2 * row_nbytes(src), dtype=torch.uint8)
    export_rows(src, [2, 5], buf)
    import_rows(dst, [7, 1], buf)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a[2].view(torch.uint8), b[7].view(torch.uint8))
        assert torch.equal(a[5].view(torch.uint8), b[1].view(torch.uint8))
    untouched = [t[3].clone() for t in dst]
    copy_rows(dst, [7], [4])
    for t, keep in zip(dst, untouched, strict=True):  # raw bytes: random bits include NaNs
        assert torch.equal(t[4].view(torch.uint8), t[7].view(torch.uint8))
        assert torch.equal(t[3].view(torch.uint8), keep.view(torch.uint8))


def test_movers_refuse_bad_buffers_and_overlaps() -> None:
    tensors = _pools()["float"]
    with pytest.raises(ValueError, match="holds 3 bytes"):
        export_rows(tensors, [0], torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        import_rows(tensors, [0], torch.empty(row_nbytes(tensors), dtype=torch.int8))
    with pytest.raises(ValueError, match="overlap"):
        copy_rows(tensors, [1, 2], [2, 3])


def test_region_over_uneven_extents_and_prefix_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """A region split in uneven arena extents holds the same bytes as one buffer; rows move in
    small staging chunks; a prefix of the pages is a prefix of the bytes."""
    import deepwell.engine_service.kv.pool as pool

    monkeypatch.setattr(pool, "CHUNK_BYTES", 1000)  # several chunks per export
    src, dst = _pools()["float"], _pools()["float"]
    _fill(src, 3)
    _fill(dst, 4)
    row = row_nbytes(src)
    arena = torch.zeros(5 * row + 100, dtype=torch.uint8)
    region = pool.Region([arena[10:10 + 2 * row + 7], arena[3 * row:3 * row + 2 * row - 7],
                          arena[5 * row + 50:5 * row + 100], arena[2 * row + 20:3 * row]])
    assert region.nbytes >= 4 * row
    export_rows(src, [1, 2, 3, 8], region)
    flat = torch.empty(4 * row, dtype=torch.uint8)
    export_rows(src, [1, 2, 3, 8], flat)
    assert torch.equal(region.read(0, 4 * row, torch.device("cpu")), flat)
    import_rows(dst, [6, 0], region)  # the first two rows only
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a[1].view(torch.uint8), b[6].view(torch.uint8))
        assert torch.equal(a[2].view(torch.uint8), b[0].view(torch.uint8))
    with pytest.raises(ValueError, match="outside a region"):
        region.read(region.nbytes - 1, 2, torch.device("cpu"))
