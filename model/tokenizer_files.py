"""A served tokenizer as a few named files, so a gateway can rebuild the replicas' own.

An engine replica sends its tokenizer to the gateway (``GetModelInfo`` of
``serving/rpc/engine.proto``) as ``{file name: bytes}``:

- ``tokenizer.model``: a SentencePiece model (``model.tokenizer.Tokenizer``), or
- ``tokenizer.json``: a ``tokenizers`` file (``model.bpe_tokenizer.BPETokenizer``);
- ``tokenizer_meta.json``: what the file alone does not say: the special ids
  (BOS, the EOS ids), whether BOS is added, the model's vocabulary size and
  the checkpoint's chat template source;
- ``chat_template.json``: present when a Jinja template is served
  (``model.chat_template_source.TemplatedTokenizer``): its source, variables
  and name. Absent: the tokenizer's own chat format (Gemma 3's).

:func:`tokenizer_id` names the bundle by a SHA-256 of its files, so a gateway
can check that every replica of one model serves the same tokenizer and template.

No JAX import here: the gateway rebuilds tokenizers with it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from model.bpe_tokenizer import BPETokenizer
from model.chat_template_source import TemplatedTokenizer
from model.jinja_chat_template import JinjaChatTemplate
from model.tokenizer import Tokenizer

META = "tokenizer_meta.json"
TEMPLATE = "chat_template.json"


def tokenizer_files(tok: Any) -> dict[str, bytes]:
    """The files of a served tokenizer.

    Args:
      tok: a ``Tokenizer``, a ``BPETokenizer`` or a ``TemplatedTokenizer`` over either.

    Returns:
      {file name: content}, see the module docstring.

    Raises:
      TypeError: another kind of tokenizer.
    """
    files: dict[str, bytes] = {}
    if isinstance(tok, TemplatedTokenizer):
        t = tok.chat_template
        files[TEMPLATE] = _json({"source": t.source, "variables": t.variables, "name": t.name})
        tok = tok._tokenizer
    if isinstance(tok, Tokenizer):
        files["tokenizer.model"] = tok.serialized_model
        kind = "sentencepiece"
    elif isinstance(tok, BPETokenizer):
        files["tokenizer.json"] = tok.backend.to_str().encode()
        kind = "tokenizers"
    else:
        raise TypeError(f"cannot send a {type(tok).__name__} to a gateway")
    files[META] = _json({"kind": kind, "bos_id": tok.bos_id, "eos_ids": list(tok.stop_token_ids),
                         "add_bos": tok.add_bos, "vocab_size": tok.vocab_size,
                         "chat_template_source": tok.chat_template_source})
    return files


def tokenizer_from_files(files: Mapping[str, bytes]) -> Any:
    """Rebuilds the tokenizer :func:`tokenizer_files` described.

    Raises:
      ValueError: a missing or malformed file, or a tokenizer its constructor refuses.
    """
    try:
        meta = json.loads(files[META])
        kind = meta["kind"]
        common = dict(bos_id=meta["bos_id"], eos_ids=meta["eos_ids"], add_bos=meta["add_bos"],
                      chat_template_source=meta["chat_template_source"], vocab_size=meta["vocab_size"])
        if kind == "sentencepiece":
            tok: Any = Tokenizer(files["tokenizer.model"], **common)
        elif kind == "tokenizers":
            from tokenizers import Tokenizer as HFTokenizer

            tok = BPETokenizer(HFTokenizer.from_str(files["tokenizer.json"].decode()), **common)
        else:
            raise ValueError(f"unknown tokenizer kind {kind!r}")
        if TEMPLATE in files:
            t = json.loads(files[TEMPLATE])
            tok = TemplatedTokenizer(tok, JinjaChatTemplate(t["source"], t["variables"], name=t["name"]))
    except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed tokenizer files ({sorted(files)}): {e!r}") from None
    return tok


def tokenizer_id(files: Mapping[str, bytes]) -> str:
    """SHA-256 hex digest of the files (names and contents, in name order)."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "big") + files[name])
    return h.hexdigest()


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False).encode()
