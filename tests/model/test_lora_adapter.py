"""Reading PEFT adapter folders (``model.lora_adapter``): what is refused and why, the digest,
and the per-row update's two formulations (``model.lora``)."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model.hf_config import read_hf_config
from model.lora import lora_delta, slot_weights, stack_shapes
from model.lora_adapter import LoraAdapterError, read_peft_adapter
from tests.support.paths import TEST_DATA

LORA = TEST_DATA / "lora_tiny"
CFG = read_hf_config(TEST_DATA / "hf_tiny" / "llama")


def _copy(tmp_path, name="llama_r8"):
    dst = tmp_path / name
    shutil.copytree(LORA / name, dst)
    return dst


def _edit_config(path, **changes):
    file = path / "adapter_config.json"
    conf = json.loads(file.read_text())
    conf.update(changes)
    file.write_text(json.dumps(conf))


@pytest.mark.parametrize("changes,message", [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(bias="all"), "bias"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    (dict(target_modules=".*proj"), "target_modules"),
    (dict(peft_type="IA3"), "peft_type"),
    (dict(r=0), "r must be"),
    (dict(r=4), "shape"),  # the tensors are rank 8
    (dict(target_modules=["q_proj"]), "does not name"),
])
def test_refused_configs_say_why(tmp_path, changes, message):
    path = _copy(tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(LoraAdapterError, match=message):
        read_peft_adapter(path, CFG)


def test_rank_above_the_servers_bound(tmp_path):
    with pytest.raises(LoraAdapterError, match="--max-lora-rank 4"):
        read_peft_adapter(LORA / "llama_r8", CFG, max_rank=4)


def test_missing_files_and_tensors(tmp_path):
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        read_peft_adapter(tmp_path, CFG)
    path = _copy(tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    dropped = {k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj.lora_B" not in k}
    save_file(dropped, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match=r"no lora_B weight of k_proj for layers \[1\]"):
        read_peft_adapter(path, CFG)
    save_file(dict(tensors, **{"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                               np.ones(48, np.float32)}), str(path / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match="DoRA magnitudes"):
        read_peft_adapter(path, CFG)
    (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraAdapterError, match="not a readable safetensors"):
        read_peft_adapter(path, CFG)


def test_moe_base_refused():
    cfg = read_hf_config(TEST_DATA / "hf_tiny" / "mixtral")
    with pytest.raises(LoraAdapterError, match="mixture-of-experts"):
        read_peft_adapter(LORA / "llama_r8", cfg)


def test_digest_names_weights_and_config_not_the_folder(tmp_path):
    a = read_peft_adapter(LORA / "llama_r8", CFG)
    same = read_peft_adapter(_copy(tmp_path, "llama_r8"), CFG)
    assert a.digest == same.digest and a.source != same.source
    (tmp_path / "changed").mkdir()
    path = _copy(tmp_path / "changed", "llama_r8")
    _edit_config(path, lora_alpha=17)
    assert read_peft_adapter(path, CFG).digest != a.digest
    _edit_config(path, lora_alpha=16)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key] + np.float32(1e-3)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    assert read_peft_adapter(path, CFG).digest != a.digest
    assert read_peft_adapter(LORA / "llama_r4", CFG).digest != a.digest


def test_slot_contents_pad_the_rank_and_fold_the_scaling():
    adapter = read_peft_adapter(LORA / "llama_rs8", CFG)
    contents = slot_weights(adapter, CFG, max_rank=16)
    shapes = stack_shapes(CFG, 2, 16)
    for p, (a, b) in contents.items():
        assert (a.shape[0], 3) + a.shape[1:] == shapes[p][0]  # [L, S, in, R] less the slot axis
        assert a.shape[-1] == b.shape[1] == 16
        if p not in adapter.weights:  # rs8 adapts q and the MLP only
            assert not a.any() and not b.any()
    wa, wb = adapter.weights["wq"]
    a, b = contents["wq"]
    np.testing.assert_array_equal(a[:, :, :8], wa)
    assert not a[:, :, 8:].any() and not b[:, 8:].any()
    np.testing.assert_allclose(b[:, :8], wb * adapter.scaling, rtol=1e-6)
    with pytest.raises(ValueError, match="above max_lora_rank"):
        slot_weights(adapter, CFG, max_rank=4)


def test_onehot_and_gather_agree_row_by_row():
    rng = np.random.default_rng(0)
    S, d_in, R, d_out, T = 4, 12, 3, 10, 7
    a = jnp.asarray(rng.normal(size=(S, d_in, R)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.normal(size=(S, R, d_out)), jnp.float32).at[0].set(0)
    x = jnp.asarray(rng.normal(size=(T, d_in)), jnp.float32)
    slots = jnp.asarray([0, 1, 2, 3, 1, 0, 3], jnp.int32)
    want = np.stack([np.asarray(x[t] @ a[s] @ b[s]) for t, s in enumerate(np.asarray(slots))])
    for formulation in ("onehot", "gather"):
        got = np.asarray(lora_delta(x, a, b, slots, jnp.float32, formulation))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert not got[0].any() and not got[5].any()  # slot 0: the base model, exactly
    with pytest.raises(ValueError, match="formulation"):
        lora_delta(x, a, b, slots, jnp.float32, "sgmv")
