"""The output pipeline (serving/output/output_processor.py) and ``xlaserve generate``'s
loop (serving/cli/generate.py) against the scripted fake engine (no JAX)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest

from serving.cli.generate import build_request, generate_text
from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    RequestRejectedError,
    SamplingParams,
    TokenEvent,
)
from serving.output.output_processor import GenerationError, TextGeneration
from tests.support.gateway_fakes import (
    BOS_ID,
    BYTE_OFFSET,
    END_OF_TURN_ID,
    EOS_ID,
    START_OF_TURN_ID,
    FakeEngine,
    FakeTokenizer,
)

pytestmark = pytest.mark.anyio

FFFD = "\ufffd"


class VisibleStopsTokenizer(FakeTokenizer):
    """Decodes the stop tokens to visible text (as some tokenizers do), so a stop
    token that reached the detokenizer would show in the output."""

    NAMES = {EOS_ID: "<eos>", END_OF_TURN_ID: "<end_of_turn>"}

    def decode(self, ids):
        parts, run = [], []  # byte runs decode together (multi-byte characters)
        for i in ids:
            if i in self.NAMES:
                parts += [super().decode(run), self.NAMES[i]]
                run = []
            else:
                run.append(i)
        return "".join(parts) + super().decode(run)


TOK = VisibleStopsTokenizer()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def byte_ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode()]


def request(max_tokens: int = 64, ignore_eos: bool = False, rid: str = "r1") -> EngineRequest:
    return EngineRequest(rid, [BOS_ID, *byte_ids("q")], SamplingParams(
        max_tokens=max_tokens, stop_token_ids=TOK.stop_token_ids, ignore_eos=ignore_eos))


async def run(engine, req=None, **kw) -> tuple[TextGeneration, list[str]]:
    gen = TextGeneration(engine, req or request(), TOK, **kw)
    await gen.start()
    async with contextlib.aclosing(gen.deltas()) as it:
        deltas = [d async for d in it]
    return gen, deltas


# ------------------------------------------------------------- stop tokens


@pytest.mark.parametrize("chunk", [1, 3, 100])
async def test_stop_token_is_counted_but_never_in_the_text(chunk):
    engine = FakeEngine(responder=lambda r: [*byte_ids("Hi!"), END_OF_TURN_ID, *byte_ids("more")],
                        chunk=chunk)
    gen, deltas = await run(engine)
    assert "".join(deltas) == "Hi!"
    assert all(deltas)  # no empty deltas
    assert gen.finish_reason == "stop"
    assert gen.completion_tokens == 4  # 3 bytes + <end_of_turn>
    assert gen.prompt_tokens == 2
    assert engine.cancelled == []  # the engine finished on its own


async def test_stop_tokens_are_dropped_even_when_the_engine_ignores_eos():
    # With ignore_eos the engine generates through stop tokens; they still never become text.
    engine = FakeEngine(responder=lambda r: [*byte_ids("a"), EOS_ID, *byte_ids("b"), EOS_ID])
    gen, deltas = await run(engine, request(max_tokens=4, ignore_eos=True))
    assert "".join(deltas) == "ab"
    assert (gen.finish_reason, gen.completion_tokens) == ("length", 4)


async def test_length_finish_and_counts():
    engine = FakeEngine(text="Hello world", cached_tokens=1)
    gen, deltas = await run(engine, request(max_tokens=5))
    assert "".join(deltas) == "Hello"
    assert (gen.finish_reason, gen.completion_tokens, gen.cached_tokens) == ("length", 5, 1)


@pytest.mark.parametrize("chunk", [1, 2, 5])
async def test_characters_split_across_tokens_arrive_whole(chunk):
    text = "Grüße, 世界! 😀"
    engine = FakeEngine(text=text, chunk=chunk)
    gen, deltas = await run(engine, request(max_tokens=100))
    assert "".join(deltas) == text and not any(FFFD in d for d in deltas)


# ------------------------------------------------------------ stop strings


@pytest.mark.parametrize("chunk", [1, 4])
async def test_stop_string_split_across_tokens_ends_the_engine_request(chunk):
    engine = FakeEngine(text="The answer is 42. END of story " + "x" * 100, chunk=chunk)
    req = request(max_tokens=200)
    gen, deltas = await run(engine, req, stop=["END", "zzz"])
    assert "".join(deltas) == "The answer is 42. "
    assert not any("E" in d for d in deltas)
    assert gen.finish_reason == "stop" and gen.stop_string == "END"
    # Tokens count up to the end of the stop string, not the rest of the event.
    assert gen.completion_tokens == len("The answer is 42. END")
    assert engine.cancelled == [req.request_id]


async def test_stop_string_on_the_final_event_does_not_cancel():
    engine = FakeEngine(text="abc END")
    gen, deltas = await run(engine, request(max_tokens=7), stop=["END"])
    assert "".join(deltas) == "abc " and gen.finish_reason == "stop"
    assert engine.cancelled == []


async def test_held_back_stop_prefix_is_released_at_the_end():
    engine = FakeEngine(text="abc EN")
    gen, deltas = await run(engine, request(max_tokens=6), stop=["END"])
    assert "".join(deltas) == "abc EN" and gen.finish_reason == "length"


# ------------------------------------------------------------ output filter


class WordFilter:
    """Stops at a word; holds back len(word) - 1 characters (a minimal OutputFilter)."""

    def __init__(self, word: str) -> None:
        self.word, self.text, self.sent = word, "", 0

    def feed(self, text: str) -> tuple[str, bool]:
        self.text += text
        i = self.text.find(self.word, self.sent)
        if i >= 0:
            out, self.sent = self.text[self.sent:i], len(self.text)
            return out, True
        safe = max(self.sent, len(self.text) - len(self.word) + 1)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> tuple[str, bool]:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, False


async def test_output_filter_ends_with_content_filter_and_cancels():
    engine = FakeEngine(text="one two zap three four")
    req = request()
    gen, deltas = await run(engine, req, output_filter=WordFilter("zap"))
    assert "".join(deltas) == "one two "
    assert gen.finish_reason == "content_filter"
    assert gen.completion_tokens == len("one two zap")
    assert engine.cancelled == [req.request_id]


async def test_the_gateway_blocklist_is_an_output_filter():
    from serving.gateway.services.policy import BlocklistPolicy

    engine = FakeEngine(text="one two zap three")
    gen, deltas = await run(engine, output_filter=BlocklistPolicy(["zap"]).output_filter())
    assert gen.finish_reason == "content_filter" and "zap" not in "".join(deltas)


async def test_output_filter_sees_the_final_flush():
    engine = FakeEngine(text="clean text")
    gen, deltas = await run(engine, output_filter=WordFilter("zap"))
    assert "".join(deltas) == "clean text" and gen.finish_reason == "stop"


# ------------------------------------------------------------- lifecycle


async def test_on_event_sees_every_event_in_order():
    engine = FakeEngine(text="abcdefg", chunk=3)
    seen: list[TokenEvent] = []
    gen, _ = await run(engine, on_event=seen.append)
    assert [e.token_ids for e in seen] == [tuple(byte_ids("abc")), tuple(byte_ids("def")),
                                          (*byte_ids("g"), EOS_ID)]
    assert seen[-1].finish_reason == "stop"


async def test_closing_the_deltas_early_cancels_the_engine_request():
    engine = FakeEngine(text="z" * 500, delay=0.001)
    req = request(max_tokens=500)
    gen = TextGeneration(engine, req, TOK)
    await gen.start()
    it = gen.deltas()
    assert await anext(it) == "z"
    await it.aclose()
    assert engine.cancelled == [req.request_id]
    assert gen.finish_reason is None
    await gen.cancel()  # idempotent
    assert engine.cancelled == [req.request_id]


async def test_a_cancelled_consumer_cancels_the_engine_request():
    engine = FakeEngine(text="z" * 500, delay=0.002)
    req = request(max_tokens=500)
    task = asyncio.ensure_future(run(engine, req))
    await asyncio.wait_for(engine.first_token.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.cancelled == [req.request_id]


async def test_leaving_the_context_manager_early_cancels():
    engine = FakeEngine(text="z" * 500, delay=0.001)
    req = request(max_tokens=500)
    async with TextGeneration(engine, req, TOK) as gen:
        async with contextlib.aclosing(gen.deltas()) as it:
            await anext(it)
    assert engine.cancelled == [req.request_id]


async def test_admission_errors_surface_from_start():
    for flag, exc in (("overloaded", EngineOverloadedError), ("reject", RequestRejectedError)):
        engine = FakeEngine(**{flag: True})
        gen = TextGeneration(engine, request(), TOK)
        with pytest.raises(exc):
            await gen.start()
        assert engine.cancelled == []


async def test_deltas_need_start_first():
    gen = TextGeneration(FakeEngine(), request(), TOK)
    with pytest.raises(RuntimeError, match="start"):
        await anext(gen.deltas())


# ---------------------------------------------------------------- errors


async def test_engine_error_raises_generation_error():
    engine = FakeEngine(text="Hello world", fail_after=3)
    gen = TextGeneration(engine, request(), TOK)
    await gen.start()
    with pytest.raises(GenerationError, match="device fell over") as e:
        await gen.collect()
    assert (e.value.reason, e.value.request_id) == ("error", "r1")
    assert engine.cancelled == []


class ScriptedEngine(FakeEngine):
    """Yields the given events as they are."""

    def __init__(self, events: list[TokenEvent]) -> None:
        super().__init__()
        self.events = events

    def submit(self, request: EngineRequest):
        self.submitted.append(request)

        async def stream():
            for e in self.events:
                yield e

        return stream()


async def test_engine_cancelled_raises_generation_error():
    engine = ScriptedEngine([TokenEvent("r1", tuple(byte_ids("ab"))),
                             TokenEvent("r1", (), finish_reason="cancelled")])
    gen = TextGeneration(engine, request(), TOK)
    await gen.start()
    with pytest.raises(GenerationError) as e:
        await gen.collect()
    assert e.value.reason == "cancelled"


async def test_a_stream_that_ends_early_raises_generation_error():
    engine = ScriptedEngine([TokenEvent("r1", tuple(byte_ids("ab")))])
    gen = TextGeneration(engine, request(), TOK)
    await gen.start()
    with pytest.raises(GenerationError, match="without a finish reason") as e:
        await gen.collect()
    assert e.value.reason is None
    gen = TextGeneration(ScriptedEngine([]), request(), TOK)
    with pytest.raises(GenerationError, match="without a result"):
        await gen.start()


# -------------------------------------------------------- xlaserve generate


async def test_generate_streams_text_and_stops_at_a_stop_string():
    engine = FakeEngine(text="Paris. And then Berlin.")
    req = build_request(TOK, "The capital of France is", max_tokens=64)
    assert list(req.prompt_ids) == TOK.encode("The capital of France is", add_bos=True)
    assert req.sampling.stop_token_ids == TOK.stop_token_ids
    written: list[str] = []
    result = await generate_text(engine, TOK, req, stop=["And"], write=written.append)
    assert result.text == "".join(written) == "Paris. "
    assert result.finish_reason == "stop"
    assert result.prompt_tokens == len(req.prompt_ids)
    assert result.completion_tokens == len("Paris. And")
    assert result.ttft_s is not None  # a first token was seen
    assert engine.cancelled == [req.request_id]
    assert "prompt tokens" in result.summary() and "tokens/s" in result.summary()


async def test_generate_drops_stop_tokens_and_reports_engine_errors():
    engine = FakeEngine(text="Bonjour")
    req = build_request(TOK, "Salut", chat=True, max_tokens=32)
    assert req.prompt_ids[:2] == [BOS_ID, START_OF_TURN_ID]
    assert req.sampling.stop_token_ids == TOK.chat_stop_token_ids  # the next turn's opening ends a chat
    assert build_request(TOK, "x").sampling.stop_token_ids == TOK.stop_token_ids
    result = await generate_text(engine, TOK, req)
    assert (result.text, result.finish_reason, result.completion_tokens) == ("Bonjour", "stop", 8)
    with pytest.raises(GenerationError):
        await generate_text(FakeEngine(fail_after=2), TOK, build_request(TOK, "x"))


class StoppableFakeEngine(FakeEngine):
    """What build_engine returns for ``xlaserve generate``: an engine with stop()."""

    stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_xlaserve_generate_command_with_a_fake_engine(monkeypatch, capsys):
    from serving.cli import generate
    from serving.cli import main as cli

    engine = StoppableFakeEngine(text="Paris. And then Berlin.")
    monkeypatch.setattr(generate, "build_engine", lambda cfg, warmup=True: (engine, TOK, "fake"))
    assert cli.main(["--log-level", "WARNING", "generate", "The capital is", "--stop", "And"]) == 0
    out, err = capsys.readouterr()
    assert out == "Paris. \n"
    assert "prompt tokens" in err and f"{len('Paris. And')} generated" in err
    assert engine.cancelled == [engine.submitted[0].request_id] and engine.stopped

    engine = StoppableFakeEngine(fail_after=2)
    monkeypatch.setattr(generate, "build_engine", lambda cfg, warmup=True: (engine, TOK, "fake"))
    assert cli.main(["--log-level", "WARNING", "generate", "x"]) == 1
    assert "xlaserve: error: device fell over" in capsys.readouterr().err and engine.stopped


# ------------------------------------------------------------------ imports


def test_the_pipeline_and_the_gateway_do_not_import_jax():
    code = ("import sys, serving.output.output_processor, serving.cli.generate, serving.gateway.app\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'jax', 'jaxlib', 'flax', 'model', 'kernels_pallas', 'sharding'})\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
