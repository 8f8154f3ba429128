"""Hugging Face checkpoint directories built at test time (nothing committed).

- :func:`write_llama_checkpoint`: ``config.json`` (``LlamaForCausalLM``) and
  ``model.safetensors`` with seeded random weights, written with the
  ``safetensors`` library. Embedding rows have equal norms and the layers are
  small, so each position's greedy next token is (almost surely) the token
  itself: a decode that repeats the prompt's last token, whose streamed chunks
  can be counted as tokens.
- :func:`write_llama3_tokenizer`: Meta's Llama 3 ``tokenizer.model`` (PyPI
  ``llama-models`` 0.3.0, a test dependency) converted by
  ``BPETokenizer.from_tiktoken`` and saved as ``tokenizer.json`` +
  ``tokenizer_config.json`` (with the Llama 3 chat template of
  ``tests/data/chat_templates/llama3``) + ``generation_config.json``.
- :func:`write_char_tokenizer`: a ``tokenizers`` character vocabulary of under
  256 ids with Llama 3's control tokens, for the 256-row fixtures of
  ``tests/data/hf_tiny``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from flax import nnx

from tests.support import hf_dir_fixtures as hfx
from tests.support.paths import REPO_ROOT

LLAMA3_TEMPLATE_CONFIG = REPO_ROOT / "tests" / "data" / "chat_templates" / "llama3" / "tokenizer_config.json"


def llama3_chat_template() -> str:
    """Meta-Llama-3-8B-Instruct's chat template (tests/data/chat_templates/README.md)."""
    return json.loads(LLAMA3_TEMPLATE_CONFIG.read_text())["chat_template"]


def write_llama_checkpoint(directory: Path, vocab_size: int, *, hidden: int = 64, layers: int = 1,
                           heads: int = 2, kv_heads: int = 1, head_dim: int = 32, ffn: int = 64,
                           seed: int = 0) -> Path:
    """A tied-embedding Llama checkpoint (float32 safetensors) in ``directory``."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((vocab_size, hidden)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)

    def small(*shape):
        return (0.01 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": emb, "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": small(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": small(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": small(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": small(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": small(ffn, hidden),
            p + "mlp.up_proj.weight": small(ffn, hidden),
            p + "mlp.down_proj.weight": small(hidden, ffn),
        })
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def llama3_tokenizer_model() -> Path:
    """Meta's Llama 3 ``tokenizer.model`` as the ``llama-models`` package ships it."""
    from llama_models.llama3 import tokenizer as meta

    return Path(meta.__file__).parent / "tokenizer.model"


def write_llama3_tokenizer(directory: Path) -> Path:
    """Llama 3's tokenizer files with its chat template in ``directory``; returns it."""
    from model.bpe_tokenizer import BPETokenizer

    tok = BPETokenizer.from_tiktoken(llama3_tokenizer_model())
    tok.save(directory)
    _add_template(directory, llama3_chat_template())
    return directory


def write_char_tokenizer(directory: Path, chat_template: str | None = None) -> Path:
    """A character-level ``tokenizer.json`` (printable ASCII, ``<unk>``, Llama 3's control tokens:
    under 100 ids) with its ``tokenizer_config.json`` and ``generation_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {"<unk>": 0}
    for c in ["\n", *map(chr, range(32, 127))]:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id("<|begin_of_text|>"),
         "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}))
    if chat_template is not None:
        _add_template(directory, chat_template)
    return directory


GEMMA3_TEMPLATE_CONFIG = REPO_ROOT / "tests" / "data" / "chat_templates" / "gemma3" / "tokenizer_config.json"


def write_gemma_char_tokenizer(directory: Path, vocab_size: int = 256) -> Path:
    """A character-level ``tokenizer.json`` for the 256-row Gemma 3 fixtures of
    ``tests/data/hf_tiny``: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, "\\n" and printable
    ASCII, ``<start_of_turn>``, ``<end_of_turn>``, fillers, and the image tokens at the ids of
    the fixtures' config (``<start_of_image>`` 253, ``<end_of_image>`` 254,
    ``<image_soft_token>`` 255); with the Gemma 3 instruction-tuned chat template
    (``tests/data/chat_templates/gemma3``), which renders image parts as ``<start_of_image>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    specials = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab = dict(specials)
    for c in ["\n", *map(chr, range(32, 127))]:
        vocab[c] = len(vocab)
    for name in ("<start_of_turn>", "<end_of_turn>"):
        vocab[name] = len(vocab)
    while len(vocab) < vocab_size - 3:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    for name in ("<start_of_image>", "<end_of_image>", "<image_soft_token>"):
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    control = [*specials, "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
               "<image_soft_token>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    template = json.loads(GEMMA3_TEMPLATE_CONFIG.read_text())["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "add_bos_token": True, "chat_template": template}, indent=1))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, vocab["<end_of_turn>"]]}))
    return directory


def gemma3_vision_dir(directory: Path) -> Path:
    """tests/data/hf_tiny/gemma3_vision (weights and config) with :func:`write_gemma_char_tokenizer`."""
    shutil.copytree(REPO_ROOT / "tests" / "data" / "hf_tiny" / "gemma3_vision", directory,
                    ignore=shutil.ignore_patterns("*.npy", "golden.json", "*.png"))
    return write_gemma_char_tokenizer(directory)


def _add_template(directory: Path, template: str) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=1, ensure_ascii=False))


HF_TINY_LLAMA = REPO_ROOT / "tests" / "data" / "hf_tiny" / "llama"


def _hf_dir(tmp_path: Path, name: str = "tiny-llama-hf") -> Path:
    """hf_tiny/llama (256 rows) with a character tokenizer and the Llama 3 chat template."""
    d = tmp_path / name
    shutil.copytree(HF_TINY_LLAMA, d, ignore=shutil.ignore_patterns("*.npy", "golden.json"))
    hfx.write_char_tokenizer(d, hfx.llama3_chat_template())
    return d


def _params(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
