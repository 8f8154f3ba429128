"""End to end: ``xlaserve serve --model DIR`` for the tiny Gemma 3 vision checkpoint
(tests/data/hf_tiny/gemma3_vision with a character tokenizer and Gemma 3's chat template,
tests/support/hf_dir_fixtures.py), and the official ``openai`` client sending a data-URL image:
an answer, the image's soft tokens in ``prompt_tokens``, the same image again served from the
prefix cache, another image not; a broken image gets a 400 naming its content part. The official
``anthropic`` client sends the same images as Messages API image blocks (a base64 source, and a
URL source held to the same rules): greedy, the same answer and prompt as the chat route's,
plain and streamed; ``count_tokens`` counts the soft tokens; bad images get Anthropic's error."""

from __future__ import annotations

import base64

import anthropic
import httpx
import openai
import pytest

from tests.support import hf_dir_fixtures as hfx
from tests.support.hf_tiny_parity import DATA
from tests.support.server_process import serve_process

MODEL_NAME = "tiny-gemma3-vision"
SERVER_ARGS = ["--max-model-len", "128", "--max-slots", "2", "--num-pages", "32", "--page-size", "8",
               "--prefill-chunk", "32", "--dtype", "float32", "--skip-warmup"]


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((DATA / "gemma3_vision" / name).read_bytes()).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = hfx.gemma3_vision_dir(tmp_path_factory.mktemp("hf") / MODEL_NAME)
    log = tmp_path_factory.mktemp("serve-vision") / "server.log"
    with serve_process(["--model", str(d), *SERVER_ARGS], log) as (_, url, _log):
        yield url


def ask(client, image_url: str):
    return client.chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe the picture."},
            {"type": "image_url", "image_url": {"url": image_url}}]}])


def test_openai_client_sends_an_image(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    first = ask(client, data_url("image_a.png"))
    assert first.choices[0].message.content and first.choices[0].finish_reason == "length"
    text_only = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=1, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe the picture."}]}])
    # "\n\n" <start_of_image> 16 soft tokens <end_of_image> "\n\n" (the char tokenizer: "\n" is a token)
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 + 1 + 16 + 1 + 2
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    again = ask(client, data_url("image_a.png"))
    assert again.choices[0].message.content == first.choices[0].message.content
    full_pages = (first.usage.prompt_tokens - 1) // 8 * 8
    assert again.usage.prompt_tokens_details.cached_tokens == full_pages

    other = ask(client, data_url("image_b.png"))
    # the pages before the one holding the image's first soft token are shared, no more
    # (<bos> <start_of_turn> u s e r \n, the text, \n \n <start_of_image>: the first soft token at 31)
    start = 1 + 1 + 4 + 1 + len("Describe the picture.") + 2 + 1
    assert other.usage.prompt_tokens_details.cached_tokens == start // 8 * 8 == 24 < full_pages

    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "data:image/png;base64," + base64.b64encode(b"not an image").decode())
    assert e.value.status_code == 400 and e.value.body["param"] == "messages[0].content[1]"
    assert ask(client, data_url("image_a.png")).choices[0].message.content == first.choices[0].message.content


def test_remote_image_urls_are_refused_by_default(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "https://example.com/cat.png")
    assert e.value.body["code"] == "image_url_not_allowed"


def anthropic_image(name: str) -> dict:
    data = base64.b64encode((DATA / "gemma3_vision" / name).read_bytes()).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def test_anthropic_client_sends_an_image_as_chat_does(server):
    chat = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)
    for name in ("image_a.png", "image_b.png"):
        want = ask(chat, data_url(name))
        content = [{"type": "text", "text": "Describe the picture."}, anthropic_image(name)]
        body = dict(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": content}])
        m = client.messages.create(**body, extra_body={"temperature": 0})
        # the chat's prompt (its token ids and the image's digest): every full page from the prefix cache
        prompt = want.usage.prompt_tokens
        assert (m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.cache_read_input_tokens) == (
            prompt, (prompt - 1) // 8 * 8)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == want.usage.completion_tokens == 4
        # the same greedy answer (whitespace alone opens no text block: messages_events.py)
        answer = want.choices[0].message.content
        assert "".join(b.text for b in m.content if b.type == "text") == (answer if answer.strip() else "")
        row = httpx.get(f"{server}/v1/requests/{m.id}").json()
        assert row["usage"]["prompt_tokens"] == prompt, row
        assert [(e["count"], e["soft_tokens"]) for e in row["events"] if e["event"] == "images"] == [(1, 16)], row
        assert client.messages.count_tokens(model=MODEL_NAME, messages=body["messages"]).input_tokens == prompt
        with client.messages.stream(**body, extra_body={"temperature": 0}) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == "".join(b.text for b in m.content if b.type == "text")
        assert final.usage.output_tokens == 4 and final.usage.cache_read_input_tokens == (prompt - 1) // 8 * 8

    broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(b"not an image").decode()}}
    remote = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    for block in (broken, remote):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL_NAME, max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "text", "text": "Describe the picture."}, block]}])
        assert e.value.status_code == 400 and e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[1]" in e.value.body["error"]["message"], e.value.body
    assert "example.com" in e.value.body["error"]["message"]
