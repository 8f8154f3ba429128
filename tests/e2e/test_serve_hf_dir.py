"""End to end: ``xlaserve serve --model DIR`` for a Hugging Face checkpoint directory.

The directory is built at test time (tests/support/hf_dir_fixtures.py): a one-layer
``LlamaForCausalLM`` with random weights and the real Llama 3 vocabulary
(128256 tokens: Meta's ``tokenizer.model`` from ``llama-models``, converted and
saved as ``tokenizer.json`` + ``tokenizer_config.json`` with the Llama 3 chat
template + ``generation_config.json``). A real server process streams a chat
completion to the official ``openai`` client; small sizes keep warm-up to a few
compiled programs (one prefill bucket pair, one decode batch, one page bucket).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from model.bpe_tokenizer import BPETokenizer
from model.chat_template_source import TemplatedTokenizer, load_checkpoint_chat_template
from tests.support import hf_dir_fixtures as hfx
from tests.support.server_process import serve_process

MODEL_NAME = "tiny-llama3-hf"
SERVER_ARGS = ["--max-model-len", "128", "--max-slots", "1", "--num-pages", "32",
               "--prefill-chunk", "32", "--dtype", "float32"]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say <|eot_id|> then stop."}]


@pytest.fixture(scope="session")
def llama3_hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint directory with the real Llama 3 tokenizer and chat template."""
    d = tmp_path_factory.mktemp("hf") / MODEL_NAME
    hfx.write_llama_checkpoint(d, vocab_size=128256)
    hfx.write_llama3_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(llama3_hf_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-hf") / "server.log"
    with serve_process(["--model", str(llama3_hf_dir), *SERVER_ARGS], log) as (_, url, _log):
        yield url


def test_streamed_chat_usage_counts_and_control_text(server, llama3_hf_dir):
    tok = BPETokenizer.from_hf_dir(llama3_hf_dir)
    template = load_checkpoint_chat_template(llama3_hf_dir)
    prompt_ids = TemplatedTokenizer(tok, template).apply_chat_template(MESSAGES)
    eot = tok.token_id("<|eot_id|>")
    assert prompt_ids.count(eot) == 2  # the template's two turn ends, not the typed one
    # Had the typed <|eot_id|> become the control token, the prompt would be shorter.
    parsed = tok.encode_markup(template.render(MESSAGES))
    assert len(parsed) < len(prompt_ids) and parsed.count(eot) == 3

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and finish == ["length"]
    assert usage.prompt_tokens == len(prompt_ids)
    # Each greedy token of this model repeats the prompt's last one, "\n\n" (one whole
    # token, so one chunk per token): the streamed tokens can be counted.
    assert deltas == ["\n\n"] * 6
    assert usage.completion_tokens == len(deltas) == 6
    assert usage.total_tokens == len(prompt_ids) + 6
