"""Loads what a ``--model`` value names (``serving.loading.model_source``): a configs/models.yaml name, a
GGUF path, a Hugging Face checkpoint directory or a Hub id, as (model, tokenizer)."""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from model.gguf_vocab import VOCAB_TYPES
from model.bpe_tokenizer import BPETokenizer
from model.config import ModelConfig
from model.factory import build_model
from model.gguf_loader import load_gguf
from model.tokenizer import Tokenizer
from serving.config.config_files import read_config
from serving.config.server_config import cache_dir
from serving.contract.tokenizer_protocol import TextTokenizer

log = logging.getLogger(__name__)


def known_models() -> dict:
    return read_config("models.yaml")


def gguf_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer a GGUF file carries: Gemma's SentencePiece vocabulary
    (``model.tokenizer.Tokenizer``, as ever) or any other vocabulary llama.cpp
    tokenizes (``model.bpe_tokenizer.BPETokenizer`` over ``model.gguf_vocab``:
    byte-level BPE with every ``tokenizer.ggml.pre`` split, Llama 2 / Mistral /
    Mixtral / Phi-3 SentencePiece, BERT WordPiece, Gemma 4), each cached under
    ``cache_dir("tokenizer")``.

    Raises:
      ValueError: neither (an unknown ``tokenizer.ggml.pre`` or
        ``tokenizer.ggml.model``), naming the file and the reason.
    """
    from filelock import FileLock

    cache = cache_dir("tokenizer")
    # One process rebuilds a vocabulary (~12 s for Gemma's 262k entries) while others wait for it.
    with FileLock(str(Path(cache) / f"{Path(path).name}.lock")):
        return _gguf_tokenizer(path, cache)


def _gguf_tokenizer(path: str | Path, cache) -> TextTokenizer:
    bpe = BPETokenizer.cached_gguf(path, cache)  # a stat; keeps the Gemma path below as it was
    if bpe is not None:
        return bpe
    try:
        return Tokenizer.from_gguf(path, cache_dir=cache)
    except (ValueError, KeyError, RuntimeError):
        pass  # not Gemma's recipe: model.gguf_vocab reads every other vocabulary type
    try:
        return BPETokenizer.from_gguf(path, cache_dir=cache)
    except ValueError as e:  # gguf_vocab.UnsupportedVocab, an unknown tokenizer.ggml.pre, ...
        reason = e
    raise ValueError(f"{Path(path).name} carries no tokenizer xlaserve can use, so its text cannot "
                     f"be served ({reason}); the loader reads the vocabulary types "
                     f"{', '.join(VOCAB_TYPES)} ('gpt2' with llama.cpp's tokenizer.ggml.pre names)") from None


def load_model(name: str, dtype: str = "float32", progress: bool = True, *, mesh=None,
               revision: str | None = None, chat_template: str | None = None,
               quantization: str = "none") -> tuple[nnx.Module, TextTokenizer]:
    """Builds the model a ``--model`` value names, and its tokenizer with the chat template to serve.

    Args:
      name: any form ``serving.loading.model_source.resolve_model`` tells apart: a key
        of configs/models.yaml (e.g. "gemma-3-270m", "tiny-random", "tiny-llama",
        "tiny-moe"), a path to a .gguf file, a Hugging Face checkpoint directory,
        or a Hub id ``org/name``. A GGUF's tokenizer is rebuilt from Gemma-style
        SentencePiece vocabularies and byte-level BPE ("gpt2": Llama 3, Qwen)
        ones (:func:`gguf_tokenizer`), and any other GGUF (e.g. a Llama 2 /
        Mixtral SentencePiece one) is refused rather than served with a
        vocabulary that is not its own. A Hugging Face checkpoint needs its
        ``tokenizer.json`` or SentencePiece ``tokenizer.model`` (:func:`hf_tokenizer`). The ``tiny-*`` test
        models come with the test vocabulary.
      dtype: "float32" or "bfloat16" (weights and matmul inputs).
      progress: show a progress bar while dequantizing a GGUF or reading safetensors.
      mesh: a ``jax.sharding.Mesh``: a Hugging Face checkpoint's tensors are read
        straight into their shardings on it (``configs/sharding.yaml`` rules);
        other sources are placed by the engine.
      revision: a Hub id's branch, tag or commit.
      chat_template: a ``--chat-template`` file served instead of the model's own.
      quantization: "none" or "int8" (``model.quantization``): int8 layer matrices and
        output head, from a GGUF's Q8_0 / Q4_0 / Q5_0 blocks exactly where it has them.

    Returns:
      (model, tokenizer); the tokenizer's ``apply_chat_template`` renders
      ``chat_template``, else the checkpoint's own (a Hugging Face directory's
      ``chat_template.jinja`` / ``tokenizer_config.json``, a BPE GGUF's
      ``tokenizer.chat_template``), else Gemma 3's built-in format.

    Raises:
      ValueError: a value that is none of the forms (the message lists them), a
        GGUF or checkpoint this loader cannot read, one without a usable
        tokenizer, an unreadable chat template, an unknown quantization, or int8
        for a mixture-of-experts model.
    """
    from model.quantization import check_quantization
    from serving.loading.model_source import resolve_model

    check_quantization(quantization)

    t0 = time.perf_counter()
    jdtype = jnp.dtype(dtype)
    models = known_models()
    source = resolve_model(name, revision=revision, registry=models)
    if source.kind == "registry":
        spec = models[name]
        if spec["source"] == "random":
            cfg = ModelConfig.from_dict(spec["config"])
            model = build_model(cfg, dtype=jdtype, rngs=nnx.Rngs(int(spec.get("seed", 0))),
                                quantization=quantization)
            return model, serve_chat_template(Tokenizer.tiny(cfg.vocab_size), chat_template)
        if spec["source"] != "gguf-package":
            raise ValueError(f"model {name!r}: unknown source {spec['source']!r}")
        path = importlib.import_module(spec["package"]).assemble()
    elif source.is_hf:
        model, tokenizer = _load_hf(source, jdtype, mesh, progress, chat_template, quantization)
        log.info("loaded %s (%s) in %.1f s", source.name, _format(dtype, quantization), time.perf_counter() - t0)
        return model, tokenizer
    else:
        path, name = source.path, source.name
    tokenizer = gguf_tokenizer(path)
    cfg, params = load_gguf(path, name=name, cache_dir=cache_dir("weights"), progress=progress,
                            quantization=quantization)
    model = build_model(cfg, params=params, dtype=jdtype, quantization=quantization)
    log.info("loaded %s (%s) in %.1f s", name, _format(dtype, quantization), time.perf_counter() - t0)
    return model, serve_chat_template(tokenizer, chat_template, gguf_chat_template(tokenizer, path))


def _format(dtype, quantization: str) -> str:
    """The served format, for the log: "bfloat16", or "bfloat16, int8 weights"."""
    return str(dtype) if quantization == "none" else f"{dtype}, {quantization} weights"


def load_vision(name: str, revision: str | None = None):
    """The vision tower (``model.gemma3_vision.Gemma3VisionTower``) of the Hugging Face
    checkpoint ``name`` names, or None: another source, or a checkpoint without a
    ``vision_config``.

    Raises:
      ValueError: a vision config or tensors the loader cannot read (``model.vision_loader``).
    """
    from model.vision_loader import load_vision_tower
    from serving.loading.model_source import resolve_model

    source = resolve_model(name, revision=revision, registry=known_models())
    if not source.is_hf:
        return None
    return load_vision_tower(source.path)


def _load_hf(source, jdtype, mesh, progress: bool, chat_template: str | None,
             quantization: str = "none"):
    """A Hugging Face checkpoint directory: its tokenizer and template first (cheap, so a
    checkpoint without them fails before its weights are read), then its weights."""
    from model.chat_template_source import load_checkpoint_chat_template
    from model.hf_config import read_hf_config
    from model.safetensors_loader import load_hf_checkpoint

    directory = source.path
    vocab = read_hf_config(directory, name=source.name).vocab_size
    tokenizer = hf_tokenizer(directory, vocab)
    served = serve_chat_template(tokenizer, chat_template, load_checkpoint_chat_template(directory))
    rules = None
    if mesh is not None:
        from sharding.rules import ShardingRules

        rules = ShardingRules.default()
    cfg, params = load_hf_checkpoint(directory, jdtype.name, mesh=mesh, rules=rules, name=source.name,
                                     progress=progress)
    return build_model(cfg, params=params, dtype=jdtype, quantization=quantization), served


def hf_tokenizer(directory: str | Path, vocab_size: int | None = None) -> TextTokenizer:
    """The tokenizer of a Hugging Face checkpoint directory (or of an xlaserve checkpoint
    converted from one): ``tokenizer.json`` (``BPETokenizer``), else a SentencePiece
    ``tokenizer.model`` (``model.tokenizer.Tokenizer.from_hf_dir``), each with
    ``tokenizer_config.json`` and ``generation_config.json``; ``vocab_size`` is the
    model's (it may pad the tokenizer's).

    Raises:
      ValueError: neither file, a ``tokenizer.model`` that is not SentencePiece (a
        tiktoken one), or a file that does not load (naming the file and field).
    """
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file() and (directory / "tokenizer.model").is_file():
        return Tokenizer.from_hf_dir(directory, vocab_size=vocab_size)
    try:
        return BPETokenizer.from_hf_dir(directory, vocab_size=vocab_size)
    except FileNotFoundError:
        raise ValueError(f"{directory} has neither tokenizer.json nor a SentencePiece tokenizer.model, "
                         f"so its text cannot be served") from None


def gguf_chat_template(tokenizer, path: str | Path):
    """The chat template a BPE GGUF carries (``tokenizer.chat_template``, kept by
    ``BPETokenizer.from_gguf``), or None: a Gemma SentencePiece GGUF keeps the built-in
    Gemma 3 format, as it always has."""
    from model.jinja_chat_template import JinjaChatTemplate

    text = getattr(tokenizer, "chat_template_source", None)
    if not text:
        return None
    return JinjaChatTemplate(text, tokenizer.special_tokens,
                             name=f"{Path(path).name} tokenizer.chat_template")


def serve_chat_template(tok, override_file=None, checkpoint_template=None):
    """``tok`` with the chat template to serve (``model.chat_template_source.pick_chat_template``).

    Args:
      tok: the model's tokenizer (its own ``apply_chat_template`` is Gemma 3's,
        or, for a ``BPETokenizer``, a refusal).
      override_file: ``--chat-template FILE``, or None.
      checkpoint_template: the model's own ``JinjaChatTemplate``, or None.

    Returns:
      ``tok`` itself when neither is given, else a ``TemplatedTokenizer`` whose
      ``apply_chat_template`` renders the chosen template (its variables: the
      checkpoint template's, else ``tok.special_tokens``).

    Raises:
      ValueError: an unreadable or invalid template file, or a tokenizer without
        ``encode_markup``.
    """
    from model.chat_template_source import TemplatedTokenizer, pick_chat_template

    template = pick_chat_template(override_file, checkpoint_template,
                                  None if checkpoint_template else getattr(tok, "special_tokens", None))
    if template is None:
        return tok
    log.info("chat template: %s", template.name)
    return TemplatedTokenizer(tok, template)
