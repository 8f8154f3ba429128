"""Speculative decoding with n-gram drafts: the proposer, the scheduler's verify rows on a fake
engine, the tiny-random engine with and without speculation (float32, greedy and seeded, stop
ids, max_tokens), Gemma 3 270M's golden greedy ids with speculation (float32) and its bfloat16
outputs with and without it, and the metrics and trace fields."""

from __future__ import annotations

import asyncio
import random

import pytest

from serving.config.server_config import ServerConfig
from serving.config.speculative_config import SpeculativeConfig
from serving.core.kv.kv_cache_manager import KVCacheManager
from serving.core.sched.sched_request import SchedRequest, Status
from serving.core.sched.scheduler import Scheduler
from serving.core.sched.speculative import accepted_count, may_speculate, propose_ngram
from serving.core.sched.step_plan import SamplingSettings, StepPlan

# -- the proposer and the rule ----------------------------------------------------------------


def test_propose_ngram_prefers_the_longest_then_the_most_recent_match():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 9, 1, 2, 3, 7, 2, 1, 2]
    # suffix (1, 2) occurs at 1 and 4: the most recent (4) is followed by 3, 7, 2, 1.
    assert propose_ngram(tokens, 4, 1, 2) == (3, 7, 2, 1)
    # with 3-grams first: (2, 1, 2) never occurred before, so the 2-gram decides.
    assert propose_ngram(tokens, 2, 2, 3) == (3, 7)
    # (9, 1, 2) is a 3-gram match that a 2-gram lookup would not pick.
    assert propose_ngram([9, 1, 2, 8, 8, 1, 2, 4, 9, 1, 2], 2, 2, 3) == (8, 8)
    assert propose_ngram(tokens, 0, 1, 2) == ()
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == ()  # no earlier occurrence
    assert propose_ngram([4, 4], 3, 2, 3) == ()  # too short for a 2-gram with a continuation
    assert propose_ngram([1, 2, 3, 4, 1, 2], 4, 3, 3) == ()  # below min_n: no 1- or 2-gram lookup


def test_propose_ngram_continues_a_repeating_run_past_the_end():
    assert propose_ngram([7, 7, 7], 4, 1, 2) == (7, 7, 7, 7)
    assert propose_ngram([0, 1, 2, 1, 2], 5, 2, 2) == (1, 2, 1, 2, 1)  # period 2 from the match at 1


def test_accepted_count_is_the_leading_agreement():
    assert accepted_count([4, 5, 6], [4, 5]) == 2
    assert accepted_count([4, 9, 6], [4, 5]) == 1
    assert accepted_count([3, 5, 6], [4, 5]) == 0  # a later agreement does not count
    assert accepted_count([8], []) == 0


def test_which_rows_may_speculate():
    assert may_speculate(SamplingSettings(temperature=0.7, top_k=5, logprobs=2), 0)
    assert not may_speculate(SamplingSettings(presence_penalty=0.5), 3)
    assert not may_speculate(SamplingSettings(repetition_penalty=1.1), 3)
    unmet = SamplingSettings(min_tokens=4, suppress_ids=(1,))
    assert not may_speculate(unmet, 3) and may_speculate(unmet, 4)


def test_settings_are_checked_at_config_time():
    assert SpeculativeConfig.from_settings(None, 4, None, None, None) is None
    c = SpeculativeConfig.from_settings("ngram", 3, None, None, None)
    assert (c.num_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.max_batch) == (3, 2, 4, 2)
    assert SpeculativeConfig.from_settings("ngram", 3, None, 1, 2).prompt_lookup_min == 1
    assert SpeculativeConfig.from_settings("ngram", 3, 6, None, None).prompt_lookup_max == 6
    for kwargs, match in ((dict(speculative="eagle", num_speculative_tokens=2), "method"),
                          (dict(speculative="ngram"), "num-speculative-tokens"),
                          (dict(speculative="ngram", num_speculative_tokens=0), "1..15"),
                          (dict(speculative="ngram", num_speculative_tokens=2, prompt_lookup_min=3,
                                prompt_lookup_max=2), "prompt_lookup_max"),
                          (dict(speculative="ngram", num_speculative_tokens=2, speculative_max_batch=0),
                           "max_batch")):
        with pytest.raises(ValueError, match=match):
            ServerConfig(**kwargs)


# -- the scheduler's verify rows on a fake engine -----------------------------------------------

VOCAB = 6


def fake_next(tokens: list[int]) -> int:
    """A fake model with few states, so its outputs repeat and n-gram drafts get accepted
    and rejected: depends on the last two tokens and the position's parity."""
    return (3 * tokens[-1] + tokens[-2] + len(tokens) % 2) % VOCAB


class FakeEngine:
    """Runs plans against host-side pages: every sampled token is computed from what the
    row's pages hold, so a wrong page, position, draft or computed count changes it."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.ps = page_size
        self.pages = [[None] * page_size for _ in range(num_pages)]
        self.slot_tokens = [None] * num_slots

    def _write(self, pages, pos, token):
        self.pages[pages[pos // self.ps]][pos % self.ps] = token

    def _read(self, pages, n):
        return [self.pages[pages[p // self.ps]][p % self.ps] for p in range(n)]

    def run(self, plan: StepPlan):
        """Returns [(request id, emitted tokens, accepted drafts)]."""
        out = []
        for row in plan.prefill:
            for i, t in enumerate(row.token_ids):
                self._write(row.page_ids, row.start + i, t)
            if row.samples:
                tok = fake_next(self._read(row.page_ids, row.end))
                self.slot_tokens[row.slot] = tok
                out.append((row.request_id, [tok], 0))
        for row in plan.decode:
            self._write(row.page_ids, row.position, self.slot_tokens[row.slot])
            tok = fake_next(self._read(row.page_ids, row.position + 1))
            self.slot_tokens[row.slot] = tok
            out.append((row.request_id, [tok], 0))
        for row in plan.verify:
            assert row.last_token == self.slot_tokens[row.slot]
            inputs = (row.last_token,) + row.draft_ids
            for j, t in enumerate(inputs):
                self._write(row.page_ids, row.position + j, t)
            sampled = [fake_next(self._read(row.page_ids, row.position + j + 1)) for j in range(len(inputs))]
            a = accepted_count(sampled, row.draft_ids)
            self.slot_tokens[row.slot] = sampled[a]
            out.append((row.request_id, sampled[:a + 1], a))
        return out


def run_alone(prompt: list[int], max_tokens: int, stop: tuple[int, ...]) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(fake_next(tokens))
        tokens.append(out[-1])
        if out[-1] in stop:
            break
    return out


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_verify_rows_give_each_request_its_tokens_alone(seed):
    """Random requests (some with penalties, which never speculate; stop ids; max_tokens)
    in a pool small enough to preempt, read back after every step as the engine loop
    does while speculating: every request's output equals its run alone, invariants hold
    after every step, drafts are both accepted and rejected, a stop id can end a row
    among its accepted drafts, and a step never exceeds the token budget."""
    rng = random.Random(seed)
    spec = SpeculativeConfig(num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, max_batch=3)
    kv = KVCacheManager(num_pages=9, page_size=4, enable_prefix_caching=True)
    sched = Scheduler(kv, num_slots=4, token_budget=12, max_prefill_tokens=8, max_prefill_seqs=2,
                      watermark_pages=1, speculative=spec)
    engine = FakeEngine(9, 4, 4)
    reqs = []
    for i in range(12):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        penalties = dict(presence_penalty=0.5) if i % 4 == 3 else {}
        stop = (rng.randrange(VOCAB),) if i % 3 == 0 else ()
        if i % 4 == 1:  # a prompt the fake model repeats: drafts accepted up to a stop among them
            g = run_alone(prompt[:2], 8, ())
            prompt = prompt[:2] + g + prompt[:2]
            stop = (next(t for j, t in enumerate(g) if j >= 2 and t not in g[:j]),)
        reqs.append(SchedRequest(f"r{i}", prompt, max_tokens=rng.randint(1, 20), stop_token_ids=stop,
                                 sampling=SamplingSettings(**penalties)))
    outs = {r.request_id: [] for r in reqs}
    pending = list(reqs)
    accepted = rejected = verify_steps_above_max_batch = cut_inside = 0
    for _ in range(500):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        running = len(sched.running)  # (admissions of this step do not count)
        plan = sched.schedule()
        assert not plan.needs_sync  # everything was read back
        assert plan.num_tokens <= sched.token_budget
        if plan.verify and running > spec.max_batch:
            verify_steps_above_max_batch += 1
        for row in plan.verify:
            assert not sched._live[row.request_id].sampling.uses_penalties
        for rid, tokens, a in engine.run(plan):
            req = sched._live.get(rid)
            if req is None or req.status is not Status.RUNNING:
                continue
            drafts = next((len(r.draft_ids) for r in plan.verify if r.request_id == rid), 0)
            accepted += a
            rejected += drafts > a
            for j, tok in enumerate(tokens):
                reason = sched.on_token(req, tok) if j == 0 else sched.on_accepted(req, tok)
                outs[rid].append(tok)
                if reason is not None:
                    sched.finish(req, reason)
                    cut_inside += j < len(tokens) - 1  # a stop among accepted drafts
                    break
        sched.check_invariants()
        if not pending and not sched.running and not sched.waiting:
            break
    assert not sched.running and not sched.waiting
    for r in reqs:
        assert outs[r.request_id] == run_alone(r.prompt_ids, r.max_tokens, r.stop_token_ids), r.request_id
    assert kv.num_free == 8
    assert accepted > 0 and rejected > 0
    assert verify_steps_above_max_batch == 0
    assert sum(r.num_preemptions for r in reqs) > 0
    assert cut_inside > 0


def test_scheduler_plans_verify_rows_only_from_host_known_tokens():
    spec = SpeculativeConfig(num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2, max_batch=2)
    kv = KVCacheManager(num_pages=32, page_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, num_slots=4, token_budget=20, max_prefill_tokens=16, max_prefill_seqs=4,
                      speculative=spec)
    req = SchedRequest("a", [1, 2, 3, 1, 2], max_tokens=10)
    sched.add(req)
    plan = sched.schedule()  # the prompt; its sampled token is in flight
    assert len(plan.prefill) == 1 and sched.speculation_wants_tokens()
    plan = sched.schedule()  # tokens in flight: a plain decode row, no drafts
    assert len(plan.decode) == 1 and not plan.verify
    assert sched.on_token(req, 3) is None and sched.on_token(req, 1) is None
    assert not sched.speculation_wants_tokens()
    plan = sched.schedule()  # host knows 1 2 3 1 2 3 1: drafts 2 3 1 2 after the 2-gram "3 1"
    assert not plan.decode and len(plan.verify) == 1
    row = plan.verify[0]
    assert (row.position, row.last_token, row.draft_ids) == (6, 1, (2, 3, 1, 2))
    assert len(row.page_ids) * 4 >= 6 + 1 + 4  # pages for every draft
    assert req.num_computed == 7 and req.num_inflight == 1 and req.num_draft_tokens == 4
    assert sched.on_token(req, 2) is None and sched.on_accepted(req, 3) is None
    assert req.num_computed == 8 and req.output_ids == [3, 1, 2, 3] and req.num_inflight == 0
    # max_tokens bounds the drafts: 6 left to generate, so at most 5 drafts (K = 4 here).
    plan = sched.schedule()
    assert len(plan.verify[0].draft_ids) == 4
    assert sched.on_token(req, 1) is None
    for tok in (2, 3, 1, 2):  # all 4 accepted plus the bonus: 9 tokens
        assert sched.on_accepted(req, tok) is None
    assert len(req.output_ids) == 9
    plan = sched.schedule()  # one token left: no room for a draft, a plain decode row
    assert len(plan.decode) == 1 and not plan.verify
    assert sched.on_token(req, 3) == "length"
    # Above max_batch no step speculates, and nobody reads back for drafts.
    sched.finish(req, "length")
    for i in range(3):
        sched.add(SchedRequest(f"b{i}", [1, 2, 1, 2], max_tokens=8))
    sched.schedule()
    assert not sched.speculation_wants_tokens()
    for r in sched.running:
        sched.on_token(r, 1)
    plan = sched.schedule()
    assert len(plan.decode) == 3 and not plan.verify


def test_k_shrinks_gradually_as_the_batch_grows():
    """With a token budget of 10 and K = 4, 1-7 running requests get K_eff = 4, 4, 2, 1, 1, 0, 0
    drafts each (min(K, 10 // R - 1)), the verify rows carry exactly that many, the step stays
    within the budget, ``speculative_tokens_now`` (the /metrics gauge) says so, and from 6
    requests on the rows decode plainly and nothing is read back for drafts. Without a budget
    K holds up to ``max_batch`` and is 0 above (the old cutoff)."""
    spec = SpeculativeConfig(method="draft", num_tokens=4, max_batch=8, token_budget=10, draft_model="tiny")
    assert [spec.tokens_at(r) for r in range(1, 10)] == [4, 4, 2, 1, 1, 0, 0, 0, 0]
    assert [spec.draft_bucket(d) for d in range(1, 5)] == [1, 2, 4, 4]
    assert [SpeculativeConfig(num_tokens=4, max_batch=2).tokens_at(r) for r in (1, 2, 3)] == [4, 4, 0]
    with pytest.raises(ValueError, match="token_budget"):
        SpeculativeConfig(num_tokens=4, token_budget=1)
    kv = KVCacheManager(num_pages=64, page_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, num_slots=8, token_budget=64, max_prefill_tokens=64, max_prefill_seqs=8,
                      speculative=spec)
    reqs, k_eff, drafts, gauge, wants = [], [], [], [], []

    def step():
        plan = sched.schedule()
        wants.append(sched.speculation_wants_tokens())  # its tokens are in flight
        for row in plan.prefill + plan.decode + plan.verify:
            sched.on_token(next(r for r in reqs if r.request_id == row.request_id), 1)
        return plan

    for n in range(1, 8):
        reqs.append(SchedRequest(f"r{n}", [1, 2, 3], max_tokens=100))
        sched.add(reqs[-1])
        step()  # its prompt (and the others' rows)
        gauge.append(sched.speculative_tokens_now())
        plan = step()
        assert plan.num_tokens <= 10 or not plan.verify
        k_eff.append(spec.tokens_at(len(sched.running)))
        drafts.append(sorted({len(r.draft_ids) for r in plan.verify}) or [0])
        assert len(plan.verify) + len(plan.decode) == n
    assert k_eff == gauge == [4, 4, 2, 1, 1, 0, 0]
    assert drafts == [[4], [4], [2], [1], [1], [0], [0]]
    assert wants == [True] * 10 + [False] * 4  # read back for drafts only while K_eff > 0


# -- the engine on the tiny-random model (float32) ------------------------------------------------

TINY_CFG = dict(max_slots=4, num_pages=64, max_model_len=256, page_size=8, prefill_chunk=32,
                min_decode_batch=2)
"""tests/serving/runtime/test_engine_loop.py's engine sizes: the prefill and decode programs are the same."""


@pytest.fixture(scope="module")
def tiny_loop(jax_cache):
    import jax.numpy as jnp
    from flax import nnx

    from model.config import ModelConfig
    from model.gemma3 import Gemma3
    from serving.config.config_files import read_config
    from serving.engine.engine import Engine, EngineConfig
    from serving.runtime.engine_loop import EngineLoop

    tiny = ModelConfig.from_dict(read_config("models.yaml")["tiny-random"]["config"])
    spec = SpeculativeConfig(num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3, max_batch=4)
    engine = Engine(Gemma3(tiny, dtype=jnp.float32, rngs=nnx.Rngs(0)), EngineConfig(**TINY_CFG, speculative=spec))
    loop = EngineLoop(engine)
    loop.start(warmup=False)
    yield loop
    loop.stop()


def run_both(loop, make_requests):
    """(events per request with speculation, the same without): the same requests, fresh ids."""
    from tests.support.engine_helpers import collect

    async def crowd():
        return await asyncio.gather(*(collect(loop, r) for r in make_requests()))

    spec = loop.scheduler.speculative
    with_spec = asyncio.run(crowd())
    loop.scheduler.speculative = None
    try:
        without = asyncio.run(crowd())
    finally:
        loop.scheduler.speculative = spec
    return with_spec, without


def tiny_prompt(n: int, offset: int) -> list[int]:
    return [2] + [(7 * i + offset) % 400 + 100 for i in range(n - 1)]


def test_tiny_outputs_equal_with_and_without_speculation(tiny_loop):
    """Six concurrent requests in four slots (greedy, seeded, one with a penalty, one with
    log probabilities): the same ids with speculation as without, drafts proposed and
    accepted, several tokens per event, the counts on the events and in the stats."""
    from tests.support.engine_helpers import request

    def reqs():
        return [request(tiny_prompt(5 + i, i), max_tokens=24, ignore_eos=True,
                        **[{}, dict(temperature=1.0, seed=i), dict(temperature=0.8, top_k=20, seed=i),
                           dict(presence_penalty=0.5), dict(logprobs=2), {}][i])
                for i in range(6)]

    before = tiny_loop.stats()
    spec, plain = run_both(tiny_loop, reqs)
    after = tiny_loop.stats()
    for (ids_s, ev_s), (ids_p, ev_p) in zip(spec, plain):
        assert ids_s == ids_p and len(ids_s) == 24
        assert ev_s[-1].finish_reason == ev_p[-1].finish_reason == "length"
    assert max(len(e.token_ids) for _, evs in spec for e in evs) > 1
    assert all(len(e.token_ids) <= 1 for _, evs in plain for e in evs)
    drafted = [evs[-1].num_draft_tokens for _, evs in spec]
    accepted = [evs[-1].num_accepted_tokens for _, evs in spec]
    assert drafted[3] == 0  # the penalty row decodes as before
    assert drafted[0] > 0 and accepted[0] > 0 and all(a <= d for a, d in zip(accepted, drafted))
    assert after.spec_draft_tokens - before.spec_draft_tokens == sum(drafted)
    assert after.spec_accepted_tokens - before.spec_accepted_tokens == sum(accepted)
    assert after.spec_verify_rows > before.spec_verify_rows
    # Log probabilities of verified tokens: those of plain decoding (float32, other matmul shapes).
    lp_s = [lp for e in spec[4][1] for lp in (e.logprobs or ())]
    lp_p = [lp for e in plain[4][1] for lp in (e.logprobs or ())]
    assert [x.token_id for x in lp_s] == [x.token_id for x in lp_p] == spec[4][0]
    assert [[t for t, _ in x.top] for x in lp_s] == [[t for t, _ in x.top] for x in lp_p]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lp_s, lp_p)) < 1e-4


def test_tiny_stop_ids_and_max_tokens_cut_verified_tokens_as_plain_decoding(tiny_loop):
    """Greedy requests with a stop id (a token of their output that first appears after a
    few tokens, so that they stop there) and with max_tokens from 2 to 11, two at a time:
    the same ids and finish reasons with and without speculation, and some stop token
    arrives in an event of several verified tokens."""
    from tests.support.engine_helpers import generate, request

    # The tiny model's greedy outputs are runs of one token: the first two prompts are the first
    # of eight candidates whose output switches to a new token after three or more, the other two
    # the first that do not (they stop by max_tokens).
    candidates = [tiny_prompt(6 + i, 3 * i) for i in range(8)]
    outs = generate(tiny_loop, [request(p, max_tokens=24, ignore_eos=True) for p in candidates])
    late = [next((t for j, t in enumerate(ids) if j >= 3 and t not in ids[:j]), None) for ids in outs]
    switching = [i for i, t in enumerate(late) if t is not None][:2]
    others = [i for i in range(8) if i not in switching][:2]
    assert len(switching) == 2, late
    prompts = [candidates[i] for i in switching + others]
    full = [outs[i] for i in switching + others]
    stops = [late[i] for i in switching] + [None, None]

    def reqs():
        return [request(p, max_tokens=24, stop_token_ids=(stop,)) if stop is not None
                else request(p, max_tokens=2 + 3 * i, ignore_eos=True)
                for i, (p, stop) in enumerate(zip(prompts, stops))]

    spec, plain = [], []
    for pair in (slice(0, 2), slice(2, 4)):  # two at a time: every step may speculate
        s, p = run_both(tiny_loop, lambda: reqs()[pair])
        spec += s
        plain += p
    for i, ((ids_s, ev_s), (ids_p, ev_p)) in enumerate(zip(spec, plain)):
        assert ids_s == ids_p, i
        assert ev_s[-1].finish_reason == ev_p[-1].finish_reason
        if stops[i] is not None:
            assert ev_s[-1].finish_reason == "stop" and ids_s == full[i][:full[i].index(stops[i]) + 1]
        else:
            assert ev_s[-1].finish_reason == "length" and len(ids_s) == 2 + 3 * i
    assert any(len(ev_s[-1].token_ids) > 1 for (_, ev_s), stop in zip(spec, stops) if stop is not None)


def test_tiny_n_choices_speculate_and_equal_their_plain_runs(tiny_loop):
    """Three choices of one prompt (a family sharing its KV pages, each its own seed; the
    first greedy): the same ids with and without speculation."""
    import itertools

    from serving.contract.engine_client import EngineRequest, SamplingParams

    counter = itertools.count()

    def reqs():
        run = next(counter)
        prompt = tiny_prompt(21, 5)  # more than two pages: the choices share full pages
        return [EngineRequest(f"fam{run}-{j}", prompt,
                              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0 if j == 0 else 1.0,
                                             seed=j), parent_id=f"fam{run}-0" if j else None)
                for j in range(3)]

    spec, plain = run_both(tiny_loop, reqs)
    assert [ids for ids, _ in spec] == [ids for ids, _ in plain]
    assert spec[0][1][-1].num_accepted_tokens > 0
    assert all(evs[-1].cached_tokens > 0 for _, evs in spec[1:])  # forked, not recomputed


# -- Gemma 3 270M ------------------------------------------------------------------------------------

GEMMA_CFG = dict(max_slots=8, num_pages=768, max_model_len=2048, prefill_chunk=256, min_decode_batch=8)
"""tests/serving/engine/test_engine_gemma.py's engine sizes (its prefill and decode programs). One 8-row decode
bucket: on the 2-core AMX test machine bfloat16 products of 1, 2 and 3+ rows round differently
(benchmarks/RESULTS.md, issue 17), and every verify step has at least 3 rows."""


def gemma_loop(gemma_params, dtype):
    import jax.numpy as jnp

    from model.gemma3 import Gemma3
    from serving.engine.engine import Engine, EngineConfig
    from serving.runtime.engine_loop import EngineLoop

    cfg, params = gemma_params
    spec = SpeculativeConfig(num_tokens=4, max_batch=4)
    engine_cfg = EngineConfig(**GEMMA_CFG, kv_dtype=jnp.dtype(dtype).name, speculative=spec)
    loop = EngineLoop(Engine(Gemma3(cfg, params=params, dtype=dtype), engine_cfg))
    loop.start(warmup=False)
    return loop


@pytest.mark.gemma
def test_gemma_float32_greedy_with_speculation_reproduces_golden(gemma_params, golden):
    """Four golden prompts together (the 712-token one verifies past the 512-token sliding
    window), 24 greedy tokens each: the golden ids up to the near-tie rule."""
    import jax.numpy as jnp

    from tests.support.engine_helpers import agree_until_near_tie, generate, request

    prompts = [p for p in golden["prompts"]
               if p["name"] in ("long_repeated_sliding_window", "code", "json", "english")]
    loop = gemma_loop(gemma_params, jnp.float32)
    try:
        before = loop.stats()
        outs = generate(loop, [request(p["ids"], max_tokens=24, ignore_eos=True) for p in prompts])
        stats = loop.stats()
    finally:
        loop.stop()
    assert len(prompts) == 4
    for p, ids in zip(prompts, outs):
        agree_until_near_tie(ids, p)
    assert stats.spec_accepted_tokens > before.spec_accepted_tokens


@pytest.mark.gemma
def test_gemma_bfloat16_outputs_equal_with_and_without_speculation(gemma_params, golden, gemma_tokenizer):
    """Greedy golden prompts and a seeded story, concurrently: bitwise the same ids (batch
    invariance: a verify step's logits are a decode step's)."""
    import jax.numpy as jnp

    from tests.support.engine_helpers import request

    story = gemma_tokenizer.encode("Once upon a time in a small village", add_bos=True)
    prompts = [p["ids"] for p in golden["prompts"] if p["name"] in ("code", "json", "emoji")]

    def reqs():
        return ([request(p, max_tokens=16, ignore_eos=True) for p in prompts]
                + [request(story, max_tokens=16, temperature=1.0, seed=42)])

    loop = gemma_loop(gemma_params, jnp.bfloat16)
    try:
        spec, plain = run_both(loop, reqs)
    finally:
        loop.stop()
    assert [ids for ids, _ in spec] == [ids for ids, _ in plain]
    assert sum(evs[-1].num_accepted_tokens for _, evs in spec) > 0


# -- metrics and the request trace ----------------------------------------------------------------


def test_metrics_and_trace_report_drafts_and_acceptance():
    import concurrent.futures

    from prometheus_client import generate_latest

    from serving.contract.engine_client import EngineStats, TokenEvent
    from serving.gateway.accounts.api_keys import ANONYMOUS
    from serving.gateway.accounts.pricing import PriceTable
    from serving.gateway.accounts.rate_limit import RateLimiter
    from serving.gateway.services.metering import Metering
    from serving.gateway.services.metrics import EngineStatsCollector, GatewayMetrics
    from serving.gateway.services.tracing import RequestTracer

    metrics = GatewayMetrics()
    stats = EngineStats(spec_verify_rows=10, spec_draft_tokens=40, spec_accepted_tokens=30)
    metrics.add_engine_collector(EngineStatsCollector(lambda: {"m": lambda: stats, "idle": lambda: EngineStats()}))
    text = generate_latest(metrics.registry).decode()
    for line in ('xlaserve:spec_decode_num_drafts_total{model_name="m"} 10.0',
                 'xlaserve:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
                 'xlaserve:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0',
                 'xlaserve:spec_decode_acceptance_rate{model_name="m"} 0.75',
                 'xlaserve:spec_decode_tokens_per_step{model_name="m"} 4.0',
                 'xlaserve:spec_decode_acceptance_rate{model_name="idle"} 0.0'):
        assert line in text, line

    class Ledger:
        rows = {}
        admitting = True  # the spool has room (the real ledger's property)

        def open_row(self, row):
            pass

        def close_row(self, request_id, values):
            self.rows[request_id] = values
            done = concurrent.futures.Future()
            done.set_result(None)
            return done

    ledger = Ledger()
    metering = Metering(ledger, PriceTable(models={}), metrics, RateLimiter(), RequestTracer(False))
    meter = metering.admit(ANONYMOUS, "r1", "x1", "m", "interactive", True, 0.0, 5, 16)
    meter.on_event(TokenEvent("r1", (7,), prompt_tokens=5))
    meter.on_event(TokenEvent("r1", (8, 9, 10), finish_reason="length", prompt_tokens=5,
                              num_draft_tokens=4, num_accepted_tokens=2))
    asyncio.run(meter.finish("ok", "length", completion_tokens=4))
    assert ledger.rows["r1"]["trace"]["speculative"] == {"draft_tokens": 4, "accepted_tokens": 2}


# -- combined stop conditions (issue 44, item 14) -----------------------------------------------


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("min_tokens", [0, 8])
def test_combined_stop_conditions_agree_with_ngram_speculation(tiny_loop, tiny_tokenizer, ignore_eos, min_tokens):
    """stop x stop_token_ids x max_tokens, for each ignore_eos x min_tokens, greedy and seeded,
    with n-gram speculation and without: the text, completion_tokens and log probabilities
    describe the same tokens, cut where docs/design/sampling-on-device.md says; speculation
    changes nothing (n-gram drafts keep seeded outputs too)."""
    from tests.support.stop_agreement import check_with_and_without_speculation, stop_cases

    cases = stop_cases(tiny_loop, tiny_tokenizer, tiny_prompt, ignore_eos, min_tokens)
    spec, plain = check_with_and_without_speculation(tiny_loop, tiny_tokenizer, cases)
    assert spec == plain
