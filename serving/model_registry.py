"""Resolves a model name (configs/models.yaml) or a GGUF path to (model, tokenizer)."""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from model.bpe_convert import NotByteLevelBPE
from model.bpe_tokenizer import BPETokenizer
from model.config import ModelConfig
from model.factory import build_model
from model.gguf_loader import load_gguf
from model.tokenizer import Tokenizer
from serving.config_files import read_config
from serving.server_config import cache_dir
from serving.tokenizer_protocol import TextTokenizer

log = logging.getLogger(__name__)


def known_models() -> dict:
    return read_config("models.yaml")


def gguf_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer a GGUF file carries: Gemma's SentencePiece vocabulary
    (``model.tokenizer.Tokenizer``, as ever) or a byte-level BPE ("gpt2") one
    (``model.bpe_tokenizer.BPETokenizer``: Llama 3, Qwen2/3), each cached under
    ``cache_dir("tokenizer")``.

    Raises:
      ValueError: neither (e.g. a Llama 2 / Mixtral SentencePiece vocabulary
        without Gemma's chat pieces, or an unknown ``tokenizer.ggml.pre``), naming
        the file and the reason.
    """
    cache = cache_dir("tokenizer")
    bpe = BPETokenizer.cached_gguf(path, cache)  # a stat; keeps the Gemma path below as it was
    if bpe is not None:
        return bpe
    try:
        return Tokenizer.from_gguf(path, cache_dir=cache)
    except (ValueError, KeyError, RuntimeError) as e:
        spm_error = e
    try:
        return BPETokenizer.from_gguf(path, cache_dir=cache)
    except NotByteLevelBPE:
        reason = spm_error
    except ValueError as e:
        reason = e
    raise ValueError(f"{Path(path).name} carries no tokenizer xlaserve can use, so its text cannot "
                     f"be served ({reason}); the loader rebuilds Gemma-style SentencePiece "
                     f"vocabularies and byte-level BPE ('gpt2') ones") from None


def load_model(name: str, dtype: str = "float32", progress: bool = True) -> tuple[nnx.Module, TextTokenizer]:
    """Builds the named model and its tokenizer.

    Args:
      name: a key of configs/models.yaml (e.g. "gemma-3-270m", "tiny-random",
        "tiny-llama", "tiny-moe") or a path to a .gguf file. The weights of any
        architecture ``model.gguf_loader`` reads load; the tokenizer is rebuilt
        from Gemma-style SentencePiece vocabularies and from byte-level BPE
        ("gpt2": Llama 3, Qwen) ones (:func:`gguf_tokenizer`), and any other GGUF
        (e.g. a Llama 2 / Mixtral SentencePiece one) is refused rather than served
        with a vocabulary that is not its own. The ``tiny-*`` test models come
        with the test vocabulary.
      dtype: "float32" or "bfloat16" (weights and matmul inputs).
      progress: show a progress bar while dequantizing a GGUF.

    Raises:
      ValueError: unknown name, a GGUF this loader cannot read, or one without a
        usable tokenizer.
    """
    t0 = time.perf_counter()
    jdtype = jnp.dtype(dtype)
    models = known_models()
    if name in models:
        spec = models[name]
        if spec["source"] == "random":
            cfg = ModelConfig.from_dict(spec["config"])
            model = build_model(cfg, dtype=jdtype, rngs=nnx.Rngs(int(spec.get("seed", 0))))
            return model, Tokenizer.tiny(cfg.vocab_size)
        if spec["source"] == "gguf-package":
            path = importlib.import_module(spec["package"]).assemble()
        else:
            raise ValueError(f"model {name!r}: unknown source {spec['source']!r}")
    elif name.endswith(".gguf") and Path(name).is_file():
        path = Path(name)
        name = path.stem
    else:
        raise ValueError(f"unknown model {name!r}: use one of {sorted(models)} or a path to a .gguf file")
    tokenizer = gguf_tokenizer(path)
    cfg, params = load_gguf(path, name=name, cache_dir=cache_dir("weights"), progress=progress)
    model = build_model(cfg, params=params, dtype=jdtype)
    log.info("loaded %s (%s) in %.1f s", name, dtype, time.perf_counter() - t0)
    return model, tokenizer
