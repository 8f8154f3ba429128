"""The draft model that ``--speculative draft --draft-model SPEC`` names, loaded and checked
against the served model's tokenizer (``serving.engine.draft_model`` runs it).

``SPEC`` is ``self:int8`` (the served model's own int8 copy, built by the engine from the
served weights: nothing to load here) or anything ``--model`` takes (a key of
configs/models.yaml, a directory, a GGUF, a Hub id), loaded in the served dtype. A draft
proposes token ids, so it must share the served model's tokenizer: :func:`check_same_tokenizer`
refuses a draft whose vocabulary or special ids differ.

``--speculative eagle3 --draft-model DIR`` names an EAGLE-3 head instead (``model.eagle3``:
its ``config.json`` and safetensors as published for Llama 3.1 8B), read by :func:`load_eagle3`
and checked against the served model's vocabulary and width; an EAGLE-3 directory given to
``--speculative draft`` is refused with a pointer to ``eagle3`` (the head is no model alone).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_SAMPLED_PIECES = 4096
"""Ids whose pieces are compared (evenly spaced over the vocabulary, with the special ids)."""


def _pieces(tok, ids) -> list:
    out = []
    for i in ids:
        try:
            out.append(tok.id_to_piece(i))
        except (ValueError, IndexError, KeyError):
            out.append(None)
    return out


def check_same_tokenizer(served, draft, served_vocab: int, draft_vocab: int) -> None:
    """Checks that a draft model proposes the served model's token ids.

    Args:
      served, draft: the two models' tokenizers (``model.tokenizer``'s ``TextTokenizer``s).
      served_vocab, draft_vocab: the two models' logit widths (``ModelConfig.vocab_size``).

    Raises:
      ValueError: naming the first difference: the tokenizers' vocabulary sizes, the
        models' logit widths, the BOS / EOS / pad ids, or the piece of some id (compared
        on up to 4,096 evenly spaced ids and the special ids).
    """
    def fail(what, a, b):
        raise ValueError(f"--draft-model: the draft model's {what} is {b!r}, the served model's {a!r}; "
                         "a draft model needs the served model's tokenizer")

    if served_vocab != draft_vocab:
        fail("vocabulary size (logits)", served_vocab, draft_vocab)
    if served.vocab_size != draft.vocab_size:
        fail("tokenizer's vocabulary size", served.vocab_size, draft.vocab_size)
    for name in ("bos_id", "eos_id", "pad_id"):
        a, b = getattr(served, name, None), getattr(draft, name, None)
        if a != b:
            fail(name, a, b)
    n = served.vocab_size
    step = max(1, n // _SAMPLED_PIECES)
    ids = sorted(set(range(0, n, step)) | {i for i in (served.bos_id, served.eos_id) if i is not None})
    for i, a, b in zip(ids, _pieces(served, ids), _pieces(draft, ids)):
        if a != b:
            fail(f"piece of id {i}", a, b)


def load_draft(cfg, served_model, served_tokenizer):
    """The draft model of a server config, or None (no draft model, or ``self:int8``: the
    engine builds that copy itself).

    Args:
      cfg: a ``serving.config.server_config.ServerConfig``.
      served_model, served_tokenizer: the served model and its tokenizer.

    Raises:
      ValueError: a ``--draft-model`` that is none of ``--model``'s forms, a draft on a
        mesh, or a tokenizer that differs (:func:`check_same_tokenizer`).
    """
    from serving.config.speculative_config import SELF_INT8
    from serving.loading.model_registry import load_model

    spec = cfg.draft_model
    if cfg.speculative == "eagle3":
        return load_eagle3(cfg, served_model)
    if cfg.speculative != "draft" or not spec or spec == SELF_INT8:
        return None
    if cfg.mesh:
        raise ValueError("--speculative draft is served on a single-device engine only (no --mesh)")
    _refuse_eagle3_dir(spec)
    draft, tok = load_model(spec, dtype=cfg.dtype)
    check_same_tokenizer(served_tokenizer, tok, served_model.cfg.vocab_size, draft.cfg.vocab_size)
    log.info("draft model %s: %s, %d layers, the served tokenizer", spec, draft.cfg.name, draft.cfg.num_layers)
    return draft


def _refuse_eagle3_dir(spec: str) -> None:
    import json
    from pathlib import Path

    from model.eagle3 import is_eagle3_config

    config = Path(spec) / "config.json"
    if config.is_file() and is_eagle3_config(json.loads(config.read_text())):
        raise ValueError(f"--draft-model {spec}: an EAGLE-3 head drafts from the served model's hidden "
                         "states; serve it with --speculative eagle3")


def load_eagle3(cfg, served_model):
    """The EAGLE-3 head of ``--speculative eagle3 --draft-model DIR`` (``model.eagle3.Eagle3Head``),
    in the served dtype, sharing the served embedding table when it has none.

    Raises:
      ValueError: a mesh, a directory that is not an EAGLE-3 head, a head made for another
        vocabulary or width, a missing or misshapen tensor (``model.eagle3.load_checkpoint``).
    """
    from pathlib import Path

    from model.eagle3 import Eagle3Head, load_checkpoint

    if cfg.mesh:
        raise ValueError("--speculative eagle3 is served on a single-device engine only (no --mesh)")
    path = Path(cfg.draft_model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--speculative eagle3 --draft-model {cfg.draft_model}: not a directory with a "
                         "config.json (an EAGLE-3 head: config.json + *.safetensors)")
    head_cfg, params = load_checkpoint(path, served_model.cfg)
    lookup = getattr(served_model, "embed_lookup", None)  # a tied low-bit table's float32 copy, if any
    embed = None if head_cfg.has_embedding else (served_model.embed if lookup is None else lookup)[...]
    head = Eagle3Head(head_cfg, params, embed, dtype=served_model.dtype)
    log.info("EAGLE-3 head %s: hidden %d, draft vocabulary %d of %d", path, head_cfg.layer.hidden_size,
             head_cfg.draft_vocab_size, head_cfg.layer.vocab_size)
    return head
