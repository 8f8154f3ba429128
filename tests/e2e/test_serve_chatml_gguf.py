"""End to end: a llama-architecture GGUF with a byte-level BPE vocabulary and a ChatML
template serves chat and stops at its end-of-turn token.

The GGUF is written at test time with gguf-py's ``GGUFWriter`` as llama.cpp's converter
writes a Qwen2.5-style instruct model: ``tokenizer.ggml.model`` "gpt2", ``.pre`` "qwen2",
merges, ``<|endoftext|>`` / ``<|im_start|>`` / ``<|im_end|>`` as control tokens, EOS and
EOT ``<|im_end|>``, a ChatML ``tokenizer.chat_template``, and the Q/K rows permuted. Its
one layer adds nothing to the residual stream (``attn_output`` and ``ffn_down`` are zero),
so each next token is a function of the last one alone: the embeddings of the chain's
tokens are unit vectors and the output head maps "\\n" (the ChatML generation prompt's
last token) -> "Hello" -> " world" -> "!" -> ``<|im_end|>``. A real ``xlaserve serve
--model that.gguf`` process answers the official ``openai`` client.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest

from model import bpe_convert
from model.bpe_tokenizer import BPETokenizer
from tests.support import bpe_fixtures as bf
from tests.support import gguf_fixtures as fx
from tests.support.server_process import serve_process

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MERGED = (b"He", b"ll", b"llo", b"Hello", b" w", b"or", b"ld", b"orld", b" world")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ANSWER = ["Hello", " world", "!"]
SPEC = dict(hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, ffn=48, theta=1e6)
SERVER_ARGS = ["--max-model-len", "128", "--max-slots", "1", "--num-pages", "32",
               "--prefill-chunk", "32", "--dtype", "float32"]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello to the world."}]
MAX_TOKENS = 16


def chatml_tokenizer(tmp_path: Path) -> BPETokenizer:
    ranks = {bytes([b]): b for b in range(256)}
    for t in MERGED:
        ranks[t] = len(ranks)
    path = bf.write_tiktoken(tmp_path / "chatml.tiktoken", ranks)
    return BPETokenizer.from_tiktoken(path, pattern=bpe_convert.QWEN2_PATTERN, special_tokens=SPECIALS,
                                      bos_token="<|endoftext|>", eos_tokens=("<|im_end|>",),
                                      add_bos=False)


def chain_weights(tok: BPETokenizer) -> dict[str, np.ndarray]:
    """HF-layout weights whose greedy continuation of "\\n" is ANSWER, then <|im_end|>."""
    spec = dict(SPEC, vocab=tok.vocab_size)
    p = fx.hf_params(spec, seed=3)
    p["layers.0.o_proj"][:] = 0.0
    p["layers.0.down_proj"][:] = 0.0
    p["norm"][:] = 1.0
    chain = [tok.encode(t)[0] for t in ["\n", *ANSWER]] + [tok.token_id("<|im_end|>")]
    assert len(set(chain)) == len(chain)
    p["lm_head"][:, :len(chain)] = 0.0
    for k, (tid, nxt) in enumerate(zip(chain, chain[1:])):
        p["embed"][tid] = np.eye(SPEC["hidden"], dtype=np.float32)[k]
        p["lm_head"][nxt, k] = 4.0  # logit 4 * sqrt(hidden) ~ 23 after the RMSNorm
    return p


@pytest.fixture(scope="module")
def chatml_gguf(tmp_path_factory) -> tuple[Path, BPETokenizer]:
    d = tmp_path_factory.mktemp("chatml")
    tok = chatml_tokenizer(d)
    im_end = tok.token_id("<|im_end|>")

    def vocab(w):
        bf.add_gguf_vocab(w, tok, "qwen2", add_bos=False, chat_template=CHATML)
        w.add_eot_token_id(im_end)

    spec = dict(SPEC, vocab=tok.vocab_size)
    path = fx.write_gguf(d / "tiny-chatml.gguf", "llama", spec, chain_weights(tok), add_vocab=vocab)
    return path, tok


@pytest.fixture(scope="module")
def server(chatml_gguf, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-chatml") / "server.log"
    with serve_process(["--model", str(chatml_gguf[0]), *SERVER_ARGS], log) as (_, url, _log):
        yield url


def test_the_gguf_serves_its_chatml_template(chatml_gguf, tmp_path, monkeypatch):
    """In process: the GGUF's vocabulary and template as ``--model`` loads them."""
    from serving.loading.model_registry import load_model

    path, base = chatml_gguf
    monkeypatch.setenv("XLASERVE_DATA_DIR", str(tmp_path / "data"))
    _, tok = load_model(str(path), progress=False)
    im_start, im_end = base.token_id("<|im_start|>"), base.token_id("<|im_end|>")
    ids = tok.apply_chat_template(MESSAGES)
    assert (ids.count(im_start), ids.count(im_end)) == (3, 2)
    assert ids[-1] == base.encode("\n")[0] and ids[0] == im_start  # no BOS
    assert im_end in tok.stop_token_ids
    assert [len(base.encode(t)) for t in ANSWER] == [1, 1, 1]


def test_chat_stops_at_im_end(server, chatml_gguf):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    (model_id,) = [m.id for m in client.models.list()]
    out = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "".join(ANSWER)
    assert "<|im_end|>" not in choice.message.content
    assert out.usage.completion_tokens <= len(ANSWER) + 1 < MAX_TOKENS

    stream = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert (text, finish) == ("".join(ANSWER), ["stop"])
