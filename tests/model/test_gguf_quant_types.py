"""Every GGML type the installed gguf-py dequantizes loads bit for bit as gguf-py dequantizes it.

For each ``GGMLQuantizationType`` a tensor of random valid blocks (random bytes, keeping
the blocks whose values are all finite: a float16 scale field must not be NaN or Inf)
is written with ``GGUFWriter``, read back with ``GGUFReader`` and passed through what
``load_gguf`` calls per tensor: ``_dequantize`` (every type) and, for the types it holds
as int8 blocks (``EXACT_INT8_TYPES``), ``_blocks`` and ``QuantizedArray.dequantize``.
Each must equal ``gguf.quants.dequantize`` of the bytes written, bit for bit (signed
zeros and all). A type gguf-py cannot dequantize is a ValueError naming the tensor
and the type when the GGUF is loaded.
"""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from model import gguf_loader
from model.gguf_loader import EXACT_INT8_TYPES, check_tensor_types, dequantizable, load_gguf
from model.quantization import GGUF_BLOCK
from tests.support import gguf_fixtures as fx

Q = gguf.GGMLQuantizationType
ROWS = 6
# What gguf 0.17 to 0.19 dequantize; the test fails if the installed gguf reads fewer.
EXPECTED = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
            "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
            "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"} | {
                n for n in ("MXFP4", "NVFP4") if n in Q.__members__}  # in gguf 0.19
READ = [t for t in Q if dequantizable(t)]


def _bits(a) -> np.ndarray:
    a = np.asarray(a, np.float32)
    return a.view(np.uint32)


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 ``(rows, cols / block * type_size)``: random blocks whose values are all finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    rng = np.random.default_rng(seed)
    kept = np.empty((0, size), np.uint8)
    while len(kept) < n:
        cand = rng.integers(0, 256, size=(4 * n, size), dtype=np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):  # the NaN / Inf blocks dropped here
            vals = np.asarray(dequantize(cand, qtype), np.float32).reshape(4 * n, block)
        kept = np.concatenate([kept, cand[np.isfinite(vals).all(axis=1)]])
    out = kept[:n].copy()
    if qtype.name in EXACT_INT8_TYPES:
        # a scale d of +0 and one of -0 (the first two bytes of these types' blocks):
        # d * q is then a signed zero, which the int8 path must reproduce
        out[0, :2] = (0x00, 0x00)
        out[1, :2] = (0x00, 0x80)
    return out.reshape(rows, cols // block * size)


def _write(path, tensors: dict[str, tuple[np.ndarray, int, object]]):
    """Writes raw tensors {name: (uint8 bytes, cols, qtype)} and reads them back."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, cols, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)  # uint8 bytes: GGUF shape from the type
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_the_installed_gguf_reads_every_expected_type():
    got = {t.name for t in READ}
    assert EXPECTED <= got, f"the installed gguf no longer dequantizes {sorted(EXPECTED - got)}"
    assert set(gguf_loader.dequantizable_types()) == got
    assert not any(dequantizable(t) for t in (Q.I32, Q.F64, Q.Q8_K))


def test_every_type_is_bit_exact_against_gguf_py(tmp_path):
    tensors, written = {}, {}
    for k, qtype in enumerate(READ):
        block = GGML_QUANT_SIZES[qtype][0]
        cols = max(2 * block, 64)
        raw = random_blocks(qtype, ROWS, cols, seed=k)
        tensors[f"t.{qtype.name}"] = (raw, cols, qtype)
        written[qtype.name] = raw
    read = _write(tmp_path / "all.gguf", tensors)
    checked_blocks = []
    for qtype in READ:
        t = read[f"t.{qtype.name}"]
        assert t.tensor_type == qtype
        raw = written[qtype.name]
        want = np.asarray(dequantize(raw, qtype), np.float32)
        cols = tensors[f"t.{qtype.name}"][1]
        assert want.shape == (ROWS, cols)
        assert np.isfinite(want).all() and np.unique(want).size > 16, qtype.name  # not degenerate
        got = gguf_loader._dequantize(t)
        assert got.dtype == np.float32 and got.shape == (ROWS, cols)
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=qtype.name)
        if qtype.name in EXACT_INT8_TYPES:
            qa = gguf_loader._blocks(t)
            assert qa.values.dtype == np.int8 and qa.scales.shape == (ROWS, cols // GGUF_BLOCK)
            host = qa.values.astype(np.float32) * np.repeat(qa.scales, GGUF_BLOCK, axis=1)
            np.testing.assert_array_equal(_bits(host), _bits(want), err_msg=f"{qtype.name} blocks")
            device = qa.dequantize(jnp.float32)
            np.testing.assert_array_equal(_bits(device), _bits(want), err_msg=f"{qtype.name} on device")
            assert np.signbit(want[0, :GGUF_BLOCK]).any() and (want[0, :GGUF_BLOCK] == 0).all()
            checked_blocks.append(qtype.name)
    assert sorted(checked_blocks) == sorted(EXACT_INT8_TYPES)


@pytest.mark.parametrize("qtype", [Q.I32, Q.F64, Q.Q8_K])
def test_a_type_that_does_not_dequantize_is_named_at_load(tmp_path, qtype):
    spec = dict(vocab=40, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, ffn=48, theta=1e4)
    if qtype == Q.Q8_K:  # a llama.cpp type gguf-py does not dequantize (16 rows of one block)
        tensor = (np.zeros((16, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    else:
        tensor = np.ones((16, 32), {Q.I32: np.int32, Q.F64: np.float64}[qtype])
    path = fx.write_gguf(tmp_path / "odd.gguf", "llama", spec, fx.hf_params(spec),
                         drop=frozenset({"blk.0.attn_v.weight"}),
                         typed_tensors={"blk.0.attn_v.weight": tensor})
    with pytest.raises(ValueError, match=rf"'blk\.0\.attn_v\.weight' is {qtype.name}: a type xlaserve "
                                         r"cannot dequantize \(gguf .* reads F32, F16, .*Q4_K"):
        load_gguf(path, progress=False)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    with pytest.raises(ValueError, match="attn_v"):
        gguf_loader._dequantize(tensors["blk.0.attn_v.weight"])
    check_tensor_types({k: v for k, v in tensors.items() if k != "blk.0.attn_v.weight"}, "odd.gguf")
