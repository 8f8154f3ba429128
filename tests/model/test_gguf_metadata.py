"""model.gguf_metadata: the fast header reader gives what gguf.GGUFReader gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from model.gguf_metadata import read_gguf_header


def _write(path, endianess=gguf.GGUFEndian.LITTLE):
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ \n")
    w.add_array("t.strs", ["a", "", "日本", "<0x0A>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("blk.0.attn_q.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("token_embd.weight", np.zeros((5, 2), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_header_equals_gguf_reader(tmp_path, endian):
    path = tmp_path / "all-types.gguf"
    _write(path, endian)
    h = read_gguf_header(path)
    r = gguf.GGUFReader(path, "r")
    want = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert want.pop("t.nested") == [1, 2, 3]  # GGUFReader flattens an array of arrays
    assert {k: v for k, v in h.metadata.items() if k != "t.nested"} == want
    assert h.metadata["t.strs"] == ["a", "", "日本", "<0x0A>"] and h.metadata["t.nested"] == [[1, 2], [3]]
    assert h.tensors == {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in r.tensors}
    assert h.tensors["blk.0.attn_q.weight"] == ((4, 3), int(gguf.GGMLQuantizationType.F32))
    assert h.version == 3


def test_not_gguf_and_truncated_headers_are_named(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ValueError, match=r"model.bin is not a GGUF file"):
        read_gguf_header(bad)
    good = tmp_path / "cut.gguf"
    _write(good)
    data = good.read_bytes()
    good.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"cut.gguf: .*(ends early|runs past the end)"):
        read_gguf_header(good)
    with pytest.raises(FileNotFoundError):
        read_gguf_header(tmp_path / "missing.gguf")
