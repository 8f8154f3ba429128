"""A tiny byte-level BPE vocabulary (tiktoken file, GGUF "gpt2" fields) for cheap tests.

``TINY_TOKENS`` after the 256 single bytes include tokens that hold part of a
character ("中" = E4 B8 AD, "文" = E6 96 87, "😀" = F0 9F 98 80) and tokens that
straddle two characters (B8 AD E6: the end of 中 and the start of 文), so that
"中文中文" encodes to ids none of whose prefixes ends on a character boundary
until the last: the hard case of incremental detokenization.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tests.support import bpe_fixtures as bf

TINY_TOKENS = (
    b"\xb8\xad", b"\x96\x87", b"\xb8\xad\xe6", b"\x96\x87\xe4",  # 中文, straddling
    b"\xf0\x9f", b"\x98\x80", b"\xf0\x9f\x98\x80", b"\x98\x81",  # 😀 and half of 😁
    b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world", b" t", b" the",
    b"in", b"ing", b"<|", b"|>", b"  ", b"   ", b"\n\n", b"12", b"123",
)
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>")


def tiny_ranks() -> dict[bytes, int]:
    """{token bytes: rank}: the 256 bytes, then ``TINY_TOKENS``."""
    ranks = {bytes([b]): b for b in range(256)}
    for t in TINY_TOKENS:
        ranks[t] = len(ranks)
    return ranks


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> Path:
    """Writes ``ranks`` as a tiktoken BPE file (``base64 rank`` lines)."""
    path.write_bytes(b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n"
                              for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    return path


def tiny_tokenizer(tmp_path: Path):
    """``BPETokenizer.from_tiktoken`` on the tiny vocabulary, Llama 3's split and ``SPECIALS``
    (BOS <|begin_of_text|>, generation stops at <|end_of_text|> and <|eot_id|>)."""
    from model.bpe_tokenizer import BPETokenizer

    path = write_tiktoken(tmp_path / "tiny.tiktoken", tiny_ranks())
    return BPETokenizer.from_tiktoken(path, special_tokens=SPECIALS,
                                      eos_tokens=("<|end_of_text|>", "<|eot_id|>"))


def add_gguf_vocab(writer, tok, pre: str, add_bos: bool | None = True, user_defined: tuple[str, ...] = (),
                   chat_template: str | None = None) -> int:
    """Writes ``tok`` (a ``BPETokenizer``) as GGUF "gpt2" tokenizer fields, as llama.cpp's
    converter does: tokens in the byte alphabet, ``"left right"`` merges, control tokens
    typed 3, those named in ``user_defined`` typed 4. Returns the vocabulary size."""
    model = json.loads(tok.backend.to_str())["model"]
    tokens = [""] * tok.vocab_size
    for t, i in model["vocab"].items():
        tokens[i] = t
    user = {tok.token_id(t) for t in user_defined}
    control = set(tok.control_tokens().values()) - user
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in control else 4 if i in user else 1 for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    writer.add_bos_token_id(tok.bos_id)
    writer.add_eos_token_id(tok.eos_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return len(tokens)


GGUF_SPEC = dict(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, ffn=48, theta=500000.0)


def _bpe_gguf(tmp_path: Path, tok, pre: str, name: str = "bpe.gguf", **kw) -> Path:
    from tests.support import gguf_fixtures as fx

    spec = dict(GGUF_SPEC, vocab=tok.vocab_size)
    return fx.write_gguf(tmp_path / name, "llama", spec, fx.hf_params(spec),
                         add_vocab=lambda w: bf.add_gguf_vocab(w, tok, pre, **kw))
