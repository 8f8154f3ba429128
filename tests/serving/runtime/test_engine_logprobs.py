"""Log probabilities, prompt log probabilities and logit processing through the engine loop
(tiny random model): against a direct forward pass, across prompt chunks and preemption."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.gemma3 import Gemma3
from serving.contract.engine_client import MAX_LOGPROBS, RequestRejectedError
from serving.engine.sample.sampling import MAX_SUPPRESS_IDS
from tests.support.engine_helpers import collect, generate, request
from tests.support.model_forward import prefill_logits
from tests.support.tiny_engine import TINY, make_loop, prompt

ATOL = 1e-4


@pytest.fixture(scope="module")
def loop(jax_cache):
    loop = make_loop()  # the usual tiny shapes (tests/support/tiny_engine.py): same programs
    loop.start(warmup=False)
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def model():
    return Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))  # make_loop's weights


REF_LEN = 64  # the reference pass pads every sequence to this length: one compiled shape


def log_softmax(model, ids, rows):
    """Log-softmax (float64) of a direct forward pass's logits at positions ``rows`` of ``ids``
    (causal: the padding after ``ids`` changes nothing before it)."""
    assert len(ids) <= REF_LEN
    x = prefill_logits(model, list(ids) + [0] * (REF_LEN - len(ids)), list(range(REF_LEN)))
    x = x[rows].astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def run(loop, req):
    return asyncio.run(collect(loop, req))


def check_entry(entry, token, ref_row, k):
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(ref_row[token], abs=ATOL)
    assert len(entry.top) == k
    want = np.argsort(-ref_row, kind="stable")[:k]
    assert [t for t, _ in entry.top] == want.tolist()
    np.testing.assert_allclose([lp for _, lp in entry.top], ref_row[want], atol=ATOL)


def test_generated_logprobs_are_the_log_softmax_of_the_logits(loop, model):
    p = prompt(9)
    ids, events = run(loop, request(p, max_tokens=6, ignore_eos=True, logprobs=3))
    plain = generate(loop, [request(p, max_tokens=6, ignore_eos=True)])[0]
    assert ids == plain  # asking for log probabilities changes no token
    entries = [e for ev in events for e in ev.logprobs or ()]
    assert len(entries) == 6 and all(len(ev.logprobs) == len(ev.token_ids) for ev in events if ev.token_ids)
    seq = p + ids
    ref = log_softmax(model, seq, list(range(len(p) - 1, len(seq) - 1)))
    for entry, tok, row in zip(entries, ids, ref):
        check_entry(entry, tok, row, 3)
    assert all(ev.prompt_logprobs is None for ev in events)


def test_logprobs_are_of_the_raw_logits_with_sampling_settings(loop, model):
    """Temperature, top-k and a penalty change the sample, not the reported log probabilities."""
    p = prompt(7, 3)
    ids, events = run(loop, request(p, max_tokens=5, ignore_eos=True, logprobs=0, temperature=0.7,
                                    top_k=5, seed=4, presence_penalty=1.0, logit_bias=((101, 2.0),)))
    ref = log_softmax(model, p + ids, list(range(len(p) - 1, len(p) + 4)))
    entries = [e for ev in events for e in ev.logprobs or ()]
    for entry, tok, row in zip(entries, ids, ref):
        check_entry(entry, tok, row, 0)


def test_prompt_logprobs_across_chunks_match_a_forward_pass(loop, model):
    p = prompt(50, 1)  # two prefill chunks of 32 tokens
    ids, events = run(loop, request(p, max_tokens=2, ignore_eos=True, logprobs=2, prompt_logprobs=4))
    first = events[0]
    assert first.token_ids and len(first.prompt_logprobs) == 50 and first.prompt_logprobs[0] is None
    assert all(ev.prompt_logprobs is None for ev in events[1:])
    ref = log_softmax(model, p + ids[:1], list(range(50)))
    for pos in range(1, 50):
        check_entry(first.prompt_logprobs[pos], p[pos], ref[pos - 1], 4)
    check_entry(first.logprobs[0], ids[0], ref[49], 2)  # the last prompt position
    assert first.cached_tokens == 0


def test_prompt_logprobs_skip_the_prefix_cache_and_score_with_max_tokens_zero(loop, model):
    p = prompt(41, 9)  # 5 full pages, cached by the first request
    generate(loop, [request(p, max_tokens=1)])
    ids, events = run(loop, request(p, max_tokens=0, prompt_logprobs=1))
    assert ids == [] and len(events) == 1
    ev = events[0]
    assert ev.finish_reason == "length" and ev.completion_tokens == 0 and ev.cached_tokens == 0
    ref = log_softmax(model, p, list(range(40)))
    for pos in range(1, 41):
        check_entry(ev.prompt_logprobs[pos], p[pos], ref[pos - 1], 1)
    ids, events = run(loop, request(p, max_tokens=1))
    assert events[-1].cached_tokens == 40  # an ordinary request still hits


def test_presence_penalty_logit_bias_and_min_tokens_steer_greedy_decoding(loop):
    p = prompt(6, 2)
    plain = generate(loop, [request(p, max_tokens=12, ignore_eos=True)])[0]
    assert len(set(plain)) < 12  # the tiny model repeats itself ...
    distinct = generate(loop, [request(p, max_tokens=12, ignore_eos=True, presence_penalty=1e4)])[0]
    assert len(set(distinct)) == 12  # ... and never does under a huge presence penalty
    biased = generate(loop, [request(p, max_tokens=4, ignore_eos=True, logit_bias=((123, 1e4),))])[0]
    assert biased == [123] * 4
    ids, events = run(loop, request(p, max_tokens=8, stop_token_ids=(plain[0], plain[1]), min_tokens=3))
    assert ids[:3] == [t for t in ids[:3] if t not in (plain[0], plain[1])] and len(ids) >= 3
    assert ids != plain[:len(ids)]


def test_penalised_neighbours_do_not_change_a_plain_request(loop):
    target = request(prompt(10, 4), max_tokens=10, ignore_eos=True)
    alone = generate(loop, [target])[0]
    others = [request(prompt(8 + i, i), max_tokens=10, ignore_eos=True, frequency_penalty=1.5,
                      repetition_penalty=1.4, logprobs=5) for i in range(3)]
    together = generate(loop, others + [request(target.prompt_ids, max_tokens=10, ignore_eos=True)])[-1]
    assert together == alone


def test_penalty_counts_survive_preemption(jax_cache):
    """Recomputed through prefill, a preempted request's output tokens count again as output."""
    # No repetition penalty here: at 1.5 it alone keeps these outputs free of repeats, which
    # would hide output tokens miscounted as prompt tokens after the recompute.
    sampling = dict(max_tokens=30, ignore_eos=True, frequency_penalty=0.6, presence_penalty=0.2)
    reqs = [request(prompt(20, i), **sampling) for i in range(4)]
    # test_engine_loop's preemption configuration (same programs): four at once must preempt.
    lp = make_loop(num_pages=13, max_model_len=96)
    plans = []
    lp.on_step = plans.append
    lp.start(warmup=False)
    try:
        crowded = generate(lp, reqs)
        assert any(p.preempted for p in plans)
        lp.on_step = None
        alone = [generate(lp, [request(r.prompt_ids, **sampling)])[0] for r in reqs]
        unpenalised = generate(lp, [request(reqs[0].prompt_ids, max_tokens=30, ignore_eos=True)])[0]
    finally:
        lp.stop()
    assert crowded == alone
    assert unpenalised != alone[0]


@pytest.mark.parametrize("bad, match", [
    (dict(logit_bias=((TINY.vocab_size, 1.0),)), "logit_bias"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=2, stop_token_ids=tuple(range(MAX_SUPPRESS_IDS + 1))), "min_tokens"),
    (dict(min_tokens=20, max_tokens=5), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(top_k=3_000_000_000), "top_k"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
])
def test_bad_sampling_is_rejected_naming_the_field(loop, bad, match):
    async def submit():
        loop.submit(request(prompt(4), **bad))

    with pytest.raises(RequestRejectedError, match=match):
        asyncio.run(submit())


def test_prompt_logprobs_batch_targets_and_lockstep_treedef():
    """The host packs each prompt token's successor (the next chunk's first token at a chunk's
    end, -1 past the prompt), and a follower rebuilds the variant's batch from its leaves."""
    import jax

    from serving.config.engine_config import EngineConfig
    from serving.core.sched.step_plan import PrefillRow, SamplingSettings
    from serving.engine.sample.token_bitmask import pad_rows
    from serving.engine.step_batch import PromptLogprobsBatch, batch_treedef

    cfg = EngineConfig(max_slots=4, num_pages=64, max_model_len=256, page_size=8, prefill_chunk=32,
                       max_prefill_seqs=2)
    wants = SamplingSettings(prompt_logprobs=2)
    rows = [PrefillRow("a", 0, 0, (5, 6, 7), (1,), False, wants, prompt_len=6, next_prompt_id=8),
            PrefillRow("b", 1, 2, (9, 10, 11), (2,), True, wants, prompt_len=4)]  # 11: an output token
    assert all(r.wants_prompt_logprobs for r in rows)
    # The engine always passes a full-width token mask (all ones: nothing constrained).
    batch = PromptLogprobsBatch.from_rows(rows, cfg, pad_rows(None, cfg.max_prefill_seqs, 4))
    assert batch.next_ids[:6].tolist() == [6, 7, 8, 10, -1, -1] and (batch.next_ids[6:] == -1).all()
    assert batch.prompt_lens[:2].tolist() == [6, 4]
    leaves = jax.tree.leaves(batch)
    rebuilt = jax.tree.unflatten(batch_treedef("prefill_logprobs"), leaves)
    assert type(rebuilt) is PromptLogprobsBatch and rebuilt.shape_key == batch.shape_key


def test_n_choices_with_penalties_equal_separate_requests(loop):
    """Children with penalties or prompt logprobs are not forked (their slot counts and prompt
    scores need the whole prompt computed in their slot): each equals the request run alone."""
    from serving.contract.engine_client import EngineRequest, SamplingParams

    p = prompt(19, 6)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=0.6),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=0.6,
                             presence_penalty=0.5),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1)]
    family = [EngineRequest(f"pen-fam-{i}", p, s, parent_id=None if i == 0 else "pen-fam-0")
              for i, s in enumerate(params)]

    async def main():
        return await asyncio.gather(*(collect(loop, r) for r in family))

    together = asyncio.run(main())
    for i, s in enumerate(params):
        alone, events = run(loop, EngineRequest(f"pen-alone-{i}", p, s))
        assert together[i][0] == alone
        assert together[i][1][-1].cached_tokens == 0
    assert together[2][1][0].prompt_logprobs == events[0].prompt_logprobs
