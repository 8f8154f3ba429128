"""A Hugging Face checkpoint placed on a mesh: each device's placement reads only its shard.

A counting wrapper around the safetensors handles (``model.safetensors_loader.safe_open``)
records the bytes every ``get_slice(...)[...]`` returns, attributed to the
``jax.make_array_from_callback`` call (one per device block) that made the read.
Each call must read exactly its block's bytes (nothing of another device's
block), every device of a split parameter must get its own call, and the
placed values must equal the ones loaded onto one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import safetensors_loader as loader
from sharding.mesh import MeshConfig, build_mesh
from sharding.rules import ShardingRules
from tests.support.paths import TEST_DATA

DATA = TEST_DATA / "hf_tiny"


class _CountingSlice:
    def __init__(self, inner, calls):
        self._inner, self._calls = inner, calls

    def __getitem__(self, index):
        arr = self._inner[index]
        if self._calls:
            self._calls[-1]["bytes"] += np.asarray(arr).nbytes
        return arr

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()


class _CountingHandle:
    def __init__(self, inner, calls):
        self._inner, self._calls = inner, calls

    def get_slice(self, name):
        return _CountingSlice(self._inner.get_slice(name), self._calls)

    def keys(self):
        return self._inner.keys()


@pytest.mark.parametrize("case, mesh_shape", [("llama", (2, 4, 1)), ("qwen3_moe", (1, 2, 4)),
                                              ("phi3", (2, 4, 1)), ("qwen2", (2, 4, 1))])
def test_each_device_reads_only_its_shard(monkeypatch, case, mesh_shape):
    groups: list[dict] = []  # one per make_array_from_callback call (one parameter)
    blocks: list[dict] = []  # one per callback (one device block); reads count into the last
    real_open, real_make = loader.safe_open, jax.make_array_from_callback
    monkeypatch.setattr(loader, "safe_open", lambda path: _CountingHandle(real_open(path), blocks))

    def counting_make(shape, sharding, callback):
        group = {"shape": shape, "sharding": sharding, "blocks": []}
        groups.append(group)

        def one_block(index):
            blocks.append({"index": index, "bytes": 0})
            group["blocks"].append(blocks[-1])
            return callback(index)
        return real_make(shape, sharding, one_block)

    monkeypatch.setattr(jax, "make_array_from_callback", counting_make)
    mesh = build_mesh(MeshConfig(*mesh_shape))
    cfg, params = loader.load_hf_checkpoint(DATA / case, "float32", mesh=mesh,
                                            rules=ShardingRules.default(), progress=False)
    monkeypatch.undo()
    assert len(groups) == len(params)
    n_dev = len(mesh.devices.flat)
    split_params = 0
    for (name, arr), g in zip(params.items(), groups):
        assert g["shape"] == arr.shape, name
        for b in g["blocks"]:  # each block read exactly its own bytes (float32 file)
            size = math.prod(len(range(*s.indices(n))) for s, n in zip(b["index"], arr.shape))
            assert b["bytes"] == size * 4, (name, b["index"], b["bytes"], size * 4)
        if arr.sharding.is_fully_replicated:
            assert len(g["blocks"]) == 1, name  # read once, put on every device
            continue
        split_params += 1
        want = arr.sharding.addressable_devices_indices_map(arr.shape)
        assert len(g["blocks"]) == len(want) == n_dev, name  # one read per device ...
        assert sorted(map(str, (b["index"] for b in g["blocks"]))) == sorted(
            map(str, want.values())), name  # ... of the block that device holds
        assert all(s.data.shape != arr.shape for s in arr.addressable_shards), name
        total = sum(b["bytes"] for b in g["blocks"])
        assert total <= math.prod(arr.shape) * 4 * n_dev / 2, name  # far from a copy per device
    assert split_params >= 6

    _, single = loader.load_hf_checkpoint(DATA / case, "float32", progress=False)
    for name, arr in params.items():
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(single[name]), err_msg=name)
    # served in bfloat16: each block is cast as it is read, on the same shardings
    _, bf16 = loader.load_hf_checkpoint(DATA / case, "bfloat16", mesh=mesh,
                                        rules=ShardingRules.default(), progress=False)
    assert bf16["wq"].dtype == jnp.bfloat16 and bf16["attn_norm"].dtype == jnp.float32
    for name, arr in bf16.items():
        assert arr.sharding == params[name].sharding, name
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(single[name]).astype(arr.dtype),
                                      err_msg=name)
