"""Loading a safetensors checkpoint holds one copy of the weights in host memory, not two.

A child process (its own memory, nothing of pytest's) loads a ~480 MB random bfloat16 Llama
checkpoint (``benchmarks.real_size.write_checkpoint``, five shard files) as ``serve`` does
(``serving.loading.model_registry.load_model``, then the ``Engine``, which stores the stacked
weights as uint16 bits on the CPU) in bfloat16 onto the CPU, where the placed weights are
host memory. Its high-water RSS over its RSS before loading must stay under 1.3x the
checkpoint's bytes: the placed weights (1.0x), one parameter being filled, one tensor read.
A loader that keeps the files mapped while reading (every page read stays resident: 2x),
gathers a stacked parameter's layers into a list and then stacks them, or converts the
whole model's arrays beside the loaded ones (the engine's uint16 storage) goes over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.real_size import SHAPES, checkpoint_bytes, write_checkpoint
from tests.support.hf_dir_fixtures import write_char_tokenizer
from tests.support.paths import REPO_ROOT

# 12 layers of 1024 wide (MLP 4096) and a 32k vocabulary, untied: 242M parameters, 484 MB in
# bfloat16; the largest parameter (a stacked MLP matrix) is 101 MB. What the process adds
# besides the weights (XLA's compiler for the engine's first programs, ~60 MB) is 0.13x.
CONFIG = {**SHAPES["tiny"], "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000}
LIMIT = 1.3

_CHILD = """
import json, sys
import jax, numpy as np
from benchmarks.real_size import peak_rss_bytes, reset_peak_rss, rss_bytes
from serving.config.engine_config import EngineConfig
from serving.engine.engine import Engine
from serving.loading.model_registry import load_model
import model.bpe_tokenizer, model.safetensors_loader, safetensors, tokenizers, tqdm  # imported before

jax.block_until_ready(jax.device_put(np.ones(4, np.float32)))
reset = reset_peak_rss()
before = rss_bytes()
model, _ = load_model(sys.argv[1], dtype="bfloat16", progress=False)
engine = Engine(model, EngineConfig(max_slots=1, num_pages=4, max_model_len=32, prefill_chunk=16))
params = jax.tree.leaves(engine.params)
jax.block_until_ready(params)
print(json.dumps(dict(before=before, peak=peak_rss_bytes(), reset=reset,
                      placed=sum(a.nbytes for a in params), dtypes=sorted({str(a.dtype) for a in params}))))
"""


def test_loading_holds_one_copy_of_the_weights(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", CONFIG, shard_bytes=100 << 20, tokenizer=False)
    write_char_tokenizer(ckpt)
    weights = checkpoint_bytes(CONFIG)
    assert 300e6 < weights < 600e6 and len(list(ckpt.glob("*.safetensors"))) >= 3
    res = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["reset"], "the kernel refused to reset VmHWM: the peak would count the imports"
    # everything was placed: bfloat16 matrices (stacked ones as uint16 bits), float32 norms
    assert r["dtypes"] == ["bfloat16", "float32", "uint16"] and weights <= r["placed"] < 1.01 * weights
    added = (r["peak"] - r["before"]) / weights
    assert added < LIMIT, (f"loading {weights / 1e6:.0f} MB took the peak RSS {added:.2f}x the "
                           f"weights over its start ({r['before'] / 1e6:.0f} MB -> {r['peak'] / 1e6:.0f} MB)")


def test_read_into_fills_a_block_slab_by_slab():
    """``read_into`` reads a stacked parameter one layer per read (a slab), casts into the
    serving dtype as it copies, and gives what ``read_block`` gives for the whole block,
    for a device's block too; a wrong ``out`` or a strided block is refused."""
    import ml_dtypes
    import numpy as np
    import pytest

    from model import hf_tensor_map as hmap
    from model.factory import abstract_params
    from model.hf_config import read_hf_config
    from model.safetensors_loader import SafetensorsCheckpoint
    from tests.support.paths import TEST_DATA

    directory = TEST_DATA / "hf_tiny" / "llama"
    cfg = read_hf_config(directory)
    ckpt = SafetensorsCheckpoint(directory)
    srcs = hmap.sources("LlamaForCausalLM", cfg)
    layout = abstract_params(cfg, "float32")
    reads = []

    def read(name, index):
        arr = ckpt.read(name, index)
        reads.append(arr.nbytes)
        return arr

    for pname in ("wq", "w_down", "embed"):
        shape = layout[pname][0]
        for index in (tuple(slice(None) for _ in shape),  # whole, and one device's block
                      (slice(1, shape[0]), *(slice(0, (n + 1) // 2) for n in shape[1:-1]), slice(None))):
            whole = hmap.read_block(srcs[pname], cfg, shape, index, read)
            reads.clear()
            out = np.empty(whole.shape, ml_dtypes.bfloat16)
            hmap.read_into(srcs[pname], cfg, shape, index, read, out, slab_bytes=1)
            np.testing.assert_array_equal(out, whole.astype(ml_dtypes.bfloat16), err_msg=pname)
            assert len(reads) == whole.shape[0], pname  # one read per row of axis 0 ...
            assert max(reads) <= whole[0].nbytes, pname  # ... of that row's bytes only
    shape = layout["wq"][0]
    with pytest.raises(ValueError, match="out has shape"):
        hmap.read_into(srcs["wq"], cfg, shape, tuple(slice(None) for _ in shape), read,
                       np.empty((1,), np.float32))
    with pytest.raises(ValueError, match="strided"):
        hmap.read_into(srcs["wq"], cfg, shape, (slice(0, None, 2), *(slice(None),) * (len(shape) - 1)),
                       read, np.empty((1,), np.float32))
