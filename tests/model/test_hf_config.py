"""``config.json`` -> ModelConfig (``model.hf_config``) and the RoPE scaling types against transformers.

tests/data/hf_tiny/rope.json holds the inverse frequencies and attention factors
transformers computes (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``) for llama3,
yarn (with and without DeepSeek's mscale pair) and linear scaling at real
models' sizes; ``model.layers.rope_inv_freq`` / ``rope_attention_factor`` must
give the same numbers from the config that ``config_from_hf`` reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from model.config import ModelConfig
from model.hf_config import HF_ARCHITECTURES, config_from_hf, read_hf_config
from model.layers import rope_attention_factor, rope_inv_freq
from tests.support.paths import TEST_DATA

DATA = TEST_DATA / "hf_tiny"

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}


@pytest.mark.parametrize("case", ["llama31_8b_llama3", "qwen3_yarn_4", "yarn_mscale",
                                  "gemma3_4b_linear_8"])
def test_rope_scaling_matches_transformers(case):
    ref = json.loads((DATA / "rope.json").read_text())["cases"][case]
    d = {**LLAMA, **ref["config"], "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    cfg = config_from_hf(d)
    got = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta_global, cfg))
    want = np.asarray(ref["inv_freq"], np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(ref["attention_factor"], rel=1e-12)
    plain = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta_global))
    assert (np.abs(plain - want) / plain).max() > 0.5  # scaling did something


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture 'BertForMaskedLM'") as e:
        config_from_hf({**LLAMA, "architectures": ["BertForMaskedLM"]})
    for arch in HF_ARCHITECTURES:
        assert arch in str(e.value)
    with pytest.raises(ValueError, match="must name one architecture"):
        config_from_hf({k: v for k, v in LLAMA.items() if k != "architectures"})


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling type 'dynamic'"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "RoPE scaling type 'longrope'"),
    ({"hidden_size": None}, "lacks 'hidden_size'"),
])
def test_unsupported_or_incomplete_configs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**LLAMA, **change})


def test_read_hf_config_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture 'GPT2LMHeadModel'"):
        read_hf_config(tmp_path)


def test_v4_and_v5_rope_spellings_read_alike():
    v4 = {**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 1024}}
    v5 = {**{k: v for k, v in LLAMA.items() if k != "rope_theta"},
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                              "original_max_position_embeddings": 1024}}
    assert config_from_hf(v4) == config_from_hf(v5)
    assert config_from_hf(v4).rope_original_max_position == 1024
    plain = config_from_hf({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling_factor is None and plain.rope_theta_global == 1e4


def test_sliding_layers_per_architecture():
    mistral = config_from_hf({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.sliding_layers == (True, True) and mistral.layer_windows() == [4096, 4096]
    assert config_from_hf({**LLAMA, "architectures": ["MistralForCausalLM"],
                           "sliding_window": None}).layer_windows() == [0, 0]
    qwen = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4,
            "head_dim": 32, "sliding_window": 128, "max_window_layers": 2}
    assert config_from_hf(qwen).layer_windows() == [0, 0, 0, 0]  # use_sliding_window off
    assert config_from_hf({**qwen, "use_sliding_window": True}).layer_windows() == [0, 0, 128, 128]
    explicit = {**qwen, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert config_from_hf(explicit).layer_windows() == [128, 0, 128, 0]
    llama = config_from_hf(LLAMA)
    assert llama.layer_windows() == [0, 0] and not llama.has_sliding_layers
    with pytest.raises(ValueError, match="layer_types must hold 4 entries"):
        config_from_hf({**qwen, "layer_types": ["full_attention"]})


def test_gemma3_text_defaults_and_the_multimodal_wrapper(caplog):
    """A Gemma3ForConditionalGeneration config.json carries a sparse text_config (what differs
    from Gemma3TextConfig's defaults), as google/gemma-3-4b-it's does."""
    import logging

    d = {"architectures": ["Gemma3ForConditionalGeneration"],
         "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                         "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                         "sliding_window": 1024},
         "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    with caplog.at_level(logging.INFO):
        cfg = config_from_hf(d, name="gemma-3-4b-it")
    assert "vision tower is skipped" in caplog.text
    assert (cfg.architecture, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "gemma3", 262208, 8, 4, 256)
    assert cfg.sliding_window == 1024 and cfg.tie_embeddings and cfg.query_pre_attn_scalar == 256
    assert [cfg.is_global_layer(i) for i in range(12)] == [False] * 5 + [True] + [False] * 5 + [True]
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor) == ("linear", 8.0)
    assert (cfg.rope_theta_global, cfg.rope_theta_local) == (1e6, 1e4)
    with pytest.raises(ValueError, match="without a 'text_config'"):
        config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_model_config_round_trips_through_json():
    """An orbax checkpoint stores the config as JSON: tuples come back as lists."""
    import dataclasses

    cfg = config_from_hf({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 64})
    again = ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg and hash(again) == hash(cfg)
    with pytest.raises(ValueError, match="sliding_layers has 1 entries"):
        dataclasses.replace(cfg, sliding_layers=(True,))
