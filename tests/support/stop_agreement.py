"""Combined stop conditions, end to end below HTTP (issue 44, item 14).

A completion request's ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` and
``max_tokens`` go through the gateway's mapping (``serving.gateway.openai.sampling_params``)
and the output pipeline (``serving.output.output_processor.TextGeneration``) on a real engine
loop; :func:`check` holds the outcome to the rules of docs/design/sampling-on-device.md
("Stop conditions"): the text, ``completion_tokens`` and the log probabilities describe the
same tokens, cut at the same place, recomputed here from the token ids alone.

Used by tests/serving/core/test_speculative.py (n-gram drafts) and test_speculative_draft.py
(a draft model), each on its module's engine with and without speculation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools

from serving.gateway.openai.sampling_params import sampling_params
from serving.gateway.schema.protocol import CompletionRequest
from serving.output.output_processor import TextGeneration

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Case:
    """One request: its prompt, how it samples and which stop conditions it sets."""

    prompt: tuple[int, ...]
    stop: str | None
    stop_id: int | None
    ignore_eos: bool
    min_tokens: int
    max_tokens: int
    seed: int | None = None  # None: greedy
    eos_bias: float = 0.0  # added to EOS's logit, so that seeded outputs meet it

    def completion_request(self) -> CompletionRequest:
        body = dict(model="tiny", prompt=list(self.prompt), max_tokens=self.max_tokens, logprobs=2,
                    temperature=0.0 if self.seed is None else 1.0, ignore_eos=self.ignore_eos,
                    min_tokens=self.min_tokens)
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop is not None:
            body["stop"] = [self.stop]
        if self.stop_id is not None:
            body["stop_token_ids"] = [self.stop_id]
        if self.eos_bias:
            body["logit_bias"] = {"1": self.eos_bias}
        return CompletionRequest(**body)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a caller is told: text, finish_reason, completion_tokens, and the ids and log
    probabilities (one per id) behind them."""

    text: str
    finish_reason: str
    completion_tokens: int
    token_ids: tuple[int, ...]
    logprob_ids: tuple[int, ...]
    stop_ids: frozenset[int]


async def _run(loop, tok, case: Case) -> Outcome:
    from serving.contract.engine_client import EngineRequest

    req = case.completion_request()
    sampling = sampling_params(req, case.max_tokens, tok)
    gen = TextGeneration(loop, EngineRequest(f"stops-{next(_ids)}", list(case.prompt), sampling), tok,
                         stop=req.stop_strings)
    await gen.start()
    async with contextlib.aclosing(gen.deltas()) as it:
        text = "".join([d async for d in it])
    return Outcome(text, gen.finish_reason, gen.completion_tokens, tuple(gen.token_ids),
                   tuple(lp.token_id for lp in gen.logprobs),
                   frozenset(() if sampling.ignore_eos else sampling.stop_token_ids))


def run_cases(loop, tok, cases: list[Case]) -> list[Outcome]:
    """Runs the cases concurrently on `loop` (an EngineLoop) through the gateway's mapping."""

    async def main():
        return await asyncio.gather(*(_run(loop, tok, c) for c in cases))

    return asyncio.run(main())


def _qualifying(text: str, stop: str, armed_at: int) -> int:
    """Start of the first occurrence of `stop` in `text` that ends past `armed_at`, or -1."""
    return text.find(stop, max(armed_at - len(stop) + 1, 0))


def check(tok, case: Case, out: Outcome) -> str:
    """Asserts the documented rules for one outcome; returns how it ended ("stop id",
    "stop string" or "length").

    Rules: the engine stops on the caller's ``stop_token_ids`` always and on the model's
    own stop ids unless ``ignore_eos``; none of them before ``min_tokens``; a stop id is
    the last token, counted and given log probabilities, never in the text; a stop string
    counts only when the text of a token after the first ``min_tokens`` completes it, and
    then the text ends before it and the tokens end with that token; ``max_tokens`` caps
    them all.
    """
    expected_stops = set(() if case.stop_id is None else (case.stop_id,))
    if not case.ignore_eos:
        expected_stops |= set(tok.stop_token_ids)
    assert out.stop_ids == expected_stops, (case, out)
    ids = list(out.token_ids)
    n = len(ids)
    assert out.completion_tokens == n == len(out.logprob_ids), (case, out)
    assert list(out.logprob_ids) == ids, (case, out)
    assert 1 <= n <= case.max_tokens, (case, out)
    stops_at = [j for j, t in enumerate(ids) if t in out.stop_ids]
    assert all(j >= case.min_tokens for j in stops_at), (case, out)

    def text_of(k: int) -> str:
        return tok.decode([t for t in ids[:k] if t not in out.stop_ids])

    full = text_of(n)
    armed_at = len(text_of(case.min_tokens).rstrip("\ufffd"))
    hit = -1 if case.stop is None else _qualifying(full, case.stop, armed_at)
    if stops_at:
        assert stops_at == [n - 1], (case, out)  # a stop id ends the output
        assert out.finish_reason == "stop" and hit < 0 and out.text == full, (case, out)
        return "stop id"
    if hit >= 0:
        # The last token completed it: without that token there is no such occurrence.
        assert _qualifying(text_of(n - 1), case.stop, armed_at) < 0, (case, out)
        assert out.finish_reason == "stop" and out.text == full[:hit], (case, out)
        return "stop string"
    assert out.finish_reason == "length" and n == case.max_tokens and out.text == full, (case, out)
    return "length"


def pick_stops(tok, ids: list[int], eos: int) -> tuple[int, str]:
    """A stop string and a stop id an output meets after a few tokens: the (printable ASCII)
    text of the first id from position 2 on that is new in it, and the first other new id
    from position 3 on whose text does not hold that string."""
    def new(j, t):
        return t != eos and t not in ids[:j]

    def text(t):
        return tok.decode([t])

    j0, t0 = next((j, t) for j, t in enumerate(ids) if j >= 2 and new(j, t) and text(t).strip()
                  and text(t).isascii() and text(t).isprintable())
    stop_id = next(t for j, t in enumerate(ids) if j >= 3 and j != j0 and new(j, t) and text(t0) not in text(t))
    return stop_id, text(t0)


def stop_cases(loop, tok, tiny_prompt, ignore_eos: bool, min_tokens: int) -> list[Case]:
    """Every pairing of a stop string, a stop id and a short or long max_tokens, for a greedy
    prompt and a seeded one (EOS biased so that it comes up), with the given ignore_eos and
    min_tokens, on the tiny-random model; the stops are picked from each prompt's own output
    (plain decoding, no stop), so that they are met."""
    from tests.support.engine_helpers import generate, request

    greedy = tiny_prompt(11, 15)  # "000000" then "33333333" then "K...": switches at 6 and 14
    seeded = tiny_prompt(8, 6)  # seed 2, EOS +3: an EOS at 12
    saved, loop.scheduler.speculative = loop.scheduler.speculative, None
    try:
        refs = generate(loop, [request(greedy, max_tokens=24, ignore_eos=True),
                               request(seeded, max_tokens=24, ignore_eos=True, temperature=1.0, seed=2,
                                       logit_bias=((1, 3.0),))])
    finally:
        loop.scheduler.speculative = saved
    cases = []
    for prompt, ref, seed, bias in ((greedy, refs[0], None, 0.0), (seeded, refs[1], 2, 3.0)):
        stop_id, stop_text = pick_stops(tok, ref, eos=1)
        for stop, sid, max_tokens in itertools.product((None, stop_text), (None, stop_id), (10, 24)):
            cases.append(Case(tuple(prompt), stop, sid, ignore_eos, min_tokens, max_tokens, seed, bias))
    return cases


def check_with_and_without_speculation(loop, tok, cases: list[Case]) -> tuple[list[Outcome], list[Outcome]]:
    """Runs `cases` with the loop's speculation (drafts must be accepted) and without it;
    checks every outcome (:func:`check`), that each way of ending occurs, that EOS comes up
    in the seeded outputs (within them with ignore_eos, else ending some), and that the
    greedy outcomes are equal both ways. Returns (with, without)."""
    before = loop.stats().spec_accepted_tokens
    spec = run_cases(loop, tok, cases)
    assert loop.stats().spec_accepted_tokens > before  # verified drafts reached the text
    saved, loop.scheduler.speculative = loop.scheduler.speculative, None
    try:
        plain = run_cases(loop, tok, cases)
    finally:
        loop.scheduler.speculative = saved
    for outs in (spec, plain):
        ends = [check(tok, c, o) for c, o in zip(cases, outs)]
        assert {"stop id", "stop string", "length"} <= set(ends), ends
        seeded = [o.token_ids for c, o in zip(cases, outs) if c.seed is not None]
        eos = 1
        if cases[0].ignore_eos:
            assert any(eos in ids[:-1] for ids in seeded), seeded
        else:
            assert any(ids[-1] == eos for ids in seeded), seeded
    assert [o for c, o in zip(cases, spec) if c.seed is None] == [o for c, o in zip(cases, plain) if c.seed is None]
    return spec, plain
