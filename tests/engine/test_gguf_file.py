"""GGUFFile (our fast parser) reads exactly what gguf.GGUFReader reads; bad files fail clearly."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from deepwell.engine_service.loading.gguf import read_metadata
from deepwell.engine_service.loading.gguf_file import GGUFFile, GGUFFormatError
from tests.engine.fixtures_smollm2 import smollm2_gguf_path


def assert_same_as_reader(path: Path) -> GGUFFile:
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(str(path))
    assert ours.metadata == read_metadata(reader)
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.dims == tuple(theirs.shape.tolist())
        assert (mine.offset, mine.n_bytes) == (theirs.data_offset, theirs.n_bytes)
        data = ours.tensor_data(mine)
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape
        assert np.array_equal(data, theirs.data), mine.name
    return ours


def write_varied(path: Path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 9.999999747378752e-06)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("c.i32", np.arange(7, dtype=np.int32))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_varied_file_matches_reader(tmp_path, alignment):
    path = tmp_path / "v.gguf"
    write_varied(path, alignment)
    f = assert_same_as_reader(path)
    m = f.metadata
    assert (m["t.u8"], m["t.i8"], m["t.u16"], m["t.i16"]) == (200, -100, 60000, -30000)
    assert (m["t.u32"], m["t.i32"], m["t.u64"], m["t.i64"]) == (4_000_000_000, -2_000_000_000, 2**63 + 5, -(2**62))
    assert (m["t.f32"], m["t.f64"], m["t.bool"], m["t.str"]) == (1e-05, 0.1, True, "héllo ✓")
    assert (m["t.strs"], m["t.ints"]) == (["a", "", "日本"], [1, -2, 3])
    assert (m["t.floats"], m["t.bools"]) == ([0.5, 1.25], [True, False])


def test_smollm2_matches_reader():
    f = assert_same_as_reader(smollm2_gguf_path())
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152 and len(f.tensors) == 272


def test_every_truncation_and_corruption_is_a_format_error(tmp_path):
    path = tmp_path / "v.gguf"
    write_varied(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    last_tensor_end = max(t.offset + t.n_bytes for t in GGUFFile(path).tensors)
    for size in sorted({*range(0, 400, 7), *range(400, len(data), 97), last_tensor_end - 1}):
        cut.write_bytes(data[:size])
        with pytest.raises(GGUFFormatError):
            GGUFFile(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFFormatError, match="bad magic"):
        GGUFFile(bad)
    bad.write_bytes(data[:4] + struct.pack("<I", 1) + data[8:])
    with pytest.raises(GGUFFormatError, match="version 1 is not supported"):
        GGUFFile(bad)
    bad.write_bytes(data[:4] + struct.pack(">I", 3) + data[8:])
    with pytest.raises(GGUFFormatError, match="big-endian"):
        GGUFFile(bad)
    # an absurd string length must not allocate or crash
    bad.write_bytes(data[:24] + struct.pack("<Q", 2**62) + data[32:])
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(bad)
