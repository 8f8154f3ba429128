"""Speculative decoding with a draft model (``--speculative draft``): the settings and the
tokenizer check, the tiny-random engine with a smaller random draft (float32: the same ids with
and without speculation, greedy and seeded, stop ids and max_tokens, drafts rejected and
accepted), and Gemma 3 270M's golden greedy ids with its own int8 copy drafting.

The engine sizes are tests/serving/core/test_speculative.py's (the same prefill, decode and
verify programs of the served model)."""

from __future__ import annotations

import dataclasses

import pytest

from serving.config.server_config import ServerConfig
from serving.config.speculative_config import SpeculativeConfig
from tests.serving.core.test_speculative import GEMMA_CFG, TINY_CFG, run_both, tiny_prompt

# -- settings and the tokenizer check ------------------------------------------------------------


def test_draft_settings_are_checked_at_config_time():
    c = SpeculativeConfig.from_settings("draft", 3, None, None, None, "self:int8")
    assert (c.method, c.num_tokens, c.draft_model) == ("draft", 3, "self:int8")
    for kwargs, match in ((dict(speculative="draft", num_speculative_tokens=2), "needs --draft-model"),
                          (dict(speculative="ngram", num_speculative_tokens=2, draft_model="x"), "draft"),
                          (dict(draft_model="self:int8"), "--speculative draft"),
                          (dict(speculative="draft", num_speculative_tokens=2, draft_model="self:q4"),
                           "self:int8")):
        with pytest.raises(ValueError, match=match):
            ServerConfig(**kwargs)


def test_a_draft_with_another_tokenizer_is_refused(tiny_tokenizer, gemma_tokenizer):
    from serving.loading.draft_source import check_same_tokenizer

    check_same_tokenizer(tiny_tokenizer, tiny_tokenizer, 512, 512)  # the same: no error
    with pytest.raises(ValueError, match="vocabulary size"):
        check_same_tokenizer(gemma_tokenizer, tiny_tokenizer, 262144, 512)
    with pytest.raises(ValueError, match="tokenizer's vocabulary size"):
        check_same_tokenizer(gemma_tokenizer, tiny_tokenizer, 512, 512)

    class Shifted:  # the tiny vocabulary with one piece changed
        vocab_size, bos_id, eos_id, pad_id = (tiny_tokenizer.vocab_size, tiny_tokenizer.bos_id,
                                              tiny_tokenizer.eos_id, tiny_tokenizer.pad_id)

        @staticmethod
        def id_to_piece(i):
            return "changed" if i == 300 else tiny_tokenizer.id_to_piece(i)

    with pytest.raises(ValueError, match="piece of id 300"):
        check_same_tokenizer(tiny_tokenizer, Shifted(), 512, 512)
    Shifted.eos_id = 7
    with pytest.raises(ValueError, match="eos_id"):
        check_same_tokenizer(tiny_tokenizer, Shifted(), 512, 512)


def test_shared_pages_split_the_budget_by_page_bytes():
    from model.config import ModelConfig
    from serving.config.config_files import read_config
    from serving.engine.draft_model import shared_pages

    tiny = ModelConfig.from_dict(read_config("models.yaml")["tiny-random"]["config"])
    assert shared_pages(4096, tiny, tiny) == 2048  # self:int8: two caches of the same pages
    assert shared_pages(4096, tiny, dataclasses.replace(tiny, num_layers=1)) == 3276  # 4096 * 4 / 5
    assert shared_pages(2, tiny, tiny) == 2


# -- the tiny-random engine with a random draft (float32) ----------------------------------------


@pytest.fixture(scope="module")
def draft_loop(jax_cache):
    """The tiny-random model served, drafted by a random 2-layer model of the same vocabulary
    (its own weights: some drafts accepted, some rejected), K = 3."""
    import jax.numpy as jnp
    from flax import nnx

    from model.config import ModelConfig
    from model.gemma3 import Gemma3
    from serving.config.config_files import read_config
    from serving.engine.engine import Engine, EngineConfig
    from serving.runtime.engine_loop import EngineLoop

    tiny = ModelConfig.from_dict(read_config("models.yaml")["tiny-random"]["config"])
    spec = SpeculativeConfig(method="draft", num_tokens=3, max_batch=4, draft_model="tiny-draft")
    draft = Gemma3(dataclasses.replace(tiny, num_layers=2), dtype=jnp.float32, rngs=nnx.Rngs(0))
    engine = Engine(Gemma3(tiny, dtype=jnp.float32, rngs=nnx.Rngs(0)), EngineConfig(**TINY_CFG, speculative=spec),
                    draft=draft)
    assert engine.draft.kv.k.shape[0] == 2 and engine.kv_cache.k.shape[0] == 4  # its own cache
    loop = EngineLoop(engine)
    loop.start(warmup=False)
    yield loop
    loop.stop()


def test_tiny_draft_outputs_equal_with_and_without_speculation(draft_loop):
    """Six concurrent requests in four slots (greedy, seeded, top-k, a penalty, log
    probabilities): the greedy ones' ids with the draft model are those without, drafts
    accepted and rejected, several tokens per event, log probabilities as plain decoding's.
    The seeded ones run to their length with speculative sampling (their distribution is
    checked below; their seeded ids are not plain decoding's)."""
    from tests.support.engine_helpers import request

    def reqs():
        return [request(tiny_prompt(5 + i, i), max_tokens=24, ignore_eos=True,
                        **[{}, dict(temperature=1.0, seed=i), dict(temperature=0.8, top_k=20, seed=i),
                           dict(presence_penalty=0.5), dict(logprobs=2), {}][i])
                for i in range(6)]

    before = draft_loop.stats()
    spec, plain = run_both(draft_loop, reqs)
    after = draft_loop.stats()
    for i, ((ids_s, ev_s), (ids_p, ev_p)) in enumerate(zip(spec, plain)):
        assert ids_s == ids_p or i in (1, 2)
        assert len(ids_s) == 24 and ev_s[-1].finish_reason == ev_p[-1].finish_reason == "length"
        assert all(0 <= t < 512 for t in ids_s)
    assert max(len(e.token_ids) for _, evs in spec for e in evs) > 1
    drafted = [evs[-1].num_draft_tokens for _, evs in spec]
    accepted = [evs[-1].num_accepted_tokens for _, evs in spec]
    assert drafted[3] == 0  # the penalty row decodes as before
    assert sum(accepted) > 0 and sum(accepted) < sum(drafted)  # accepted and rejected drafts
    assert drafted[1] > 0 and drafted[2] > 0 and accepted[2] > 0  # temperature rows speculate
    assert after.spec_accepted_tokens - before.spec_accepted_tokens == sum(accepted)
    lp_s = [lp for e in spec[4][1] for lp in (e.logprobs or ())]
    lp_p = [lp for e in plain[4][1] for lp in (e.logprobs or ())]
    assert [x.token_id for x in lp_s] == [x.token_id for x in lp_p] == spec[4][0]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lp_s, lp_p)) < 1e-4


def test_tiny_draft_many_prompts_stop_ids_and_max_tokens(draft_loop):
    """64 random greedy prompts of 3-40 tokens (the longest over a prefill chunk), four at a
    time, every third with a stop id from its own output, the others with max_tokens 3-66:
    the same ids and finish reasons with the draft model as without, and drafts accepted."""
    import random

    from tests.support.engine_helpers import generate, request

    rng = random.Random(46)
    prompts = [[2] + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(64)]
    full = generate(draft_loop, [request(p, max_tokens=25, ignore_eos=True) for p in prompts])
    stops = [ids[rng.randrange(1, 20)] if i % 3 == 0 else None for i, ids in enumerate(full)]

    def reqs(group):
        return [request(prompts[i], max_tokens=25, stop_token_ids=(stops[i],)) if stops[i] is not None
                else request(prompts[i], max_tokens=3 + i, ignore_eos=True) for i in group]

    before = draft_loop.stats().spec_accepted_tokens
    for i in range(0, 64, 4):
        spec, plain = run_both(draft_loop, lambda: reqs(range(i, i + 4)))
        for j, ((ids_s, ev_s), (ids_p, ev_p)) in enumerate(zip(spec, plain)):
            assert ids_s == ids_p, i + j
            assert ev_s[-1].finish_reason == ev_p[-1].finish_reason
            if stops[i + j] is None:
                assert len(ids_s) == 3 + i + j
            else:
                assert ids_s[-1] == stops[i + j] and ev_s[-1].finish_reason == "stop"
    assert draft_loop.stats().spec_accepted_tokens > before


# -- Gemma 3 270M drafted by its own int8 copy ---------------------------------------------------


@pytest.mark.gemma
@pytest.mark.slow(60)
def test_gemma_float32_greedy_with_self_int8_drafts_reproduces_golden(gemma_params, golden):
    """Three golden prompts together, 24 greedy tokens each, drafted by Gemma's own int8 copy
    (K = 4) through the default draft vocabulary (a head of 32768 of the 262144 ids,
    ``serving.config.draft_vocab``): the golden ids up to the near-tie rule, most drafts accepted.

    Slow: compiles Gemma's float32 verify step with device drafts and the int8 copy's propose
    step (4 draft steps, 8-row bucket) besides the served prefill and decode programs of
    tests/serving/core/test_speculative.py's sizes: 60 s on a cold cache on the loaded 2-core
    machine, under 30 s warm."""
    import jax.numpy as jnp

    from model.gemma3 import Gemma3
    from serving.engine.engine import Engine, EngineConfig
    from serving.runtime.engine_loop import EngineLoop
    from tests.support.engine_helpers import agree_until_near_tie, generate, request

    cfg, params = gemma_params
    spec = SpeculativeConfig(method="draft", num_tokens=4, max_batch=4, draft_model="self:int8")
    loop = EngineLoop(Engine(Gemma3(cfg, params=params, dtype=jnp.float32),
                             EngineConfig(**GEMMA_CFG, kv_dtype="float32", speculative=spec)))
    prompts = [p for p in golden["prompts"]
               if p["name"] in ("code", "json", "english")]
    loop.start(warmup=False)
    try:
        outs = generate(loop, [request(p["ids"], max_tokens=24, ignore_eos=True) for p in prompts])
        stats = loop.stats()
    finally:
        loop.stop()
    assert len(prompts) == 3
    for p, ids in zip(prompts, outs):
        agree_until_near_tie(ids, p)
    assert stats.spec_accepted_tokens > 0.5 * stats.spec_draft_tokens > 0


# -- speculative sampling's distribution ------------------------------------------------------------


def _chi_square_p(counts, probs) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``probs`` (categories
    expecting fewer than 5 pooled into one), from JAX's regularized upper incomplete gamma."""
    import jax.scipy.special as jsp
    import numpy as np

    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    return float(jsp.gammaincc((keep.sum() - 1) / 2, stat / 2))


def test_speculative_sampling_emits_the_served_distribution():
    """20,000 first tokens of one temperature row: the draft drawn from q, accepted with
    min(1, p/q), else the residual sample: their counts fit p (chi-square p > 0.01), while
    a deliberately wrong rule (accept with probability p(x), forgetting q) is found
    different (p < 1e-6). p and q are two random 64-token distributions of temperature 1."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from serving.engine.sample.rejection import (ACCEPT_STREAM, RESIDUAL_STREAM, accept_and_residual,
                                                 draft_sample, stream_keys)
    from serving.engine.sample.sampling import SamplingArrays

    V, N = 64, 20_000
    key_p, key_q = jax.random.split(jax.random.PRNGKey(46))
    p_logits = 1.5 * jax.random.normal(key_p, (V,))
    q_logits = 1.5 * jax.random.normal(key_q, (V,))
    p = np.asarray(jax.nn.softmax(p_logits))
    seeds = jnp.arange(N, dtype=jnp.uint32)
    pos = jnp.full((N,), 7, jnp.int32)
    s = SamplingArrays(jnp.ones(N), jnp.zeros(N, jnp.int32), jnp.ones(N), seeds)
    x, q = draft_sample(jnp.broadcast_to(q_logits, (N, V)), pos, s)
    assert np.allclose(np.asarray(q[0]), np.asarray(jax.nn.softmax(q_logits)), atol=1e-6)
    pp = jnp.broadcast_to(jnp.asarray(p), (N, V))
    accept, residual = accept_and_residual(pp, q, x, stream_keys(seeds, pos, ACCEPT_STREAM),
                                           stream_keys(seeds, pos, RESIDUAL_STREAM))
    emitted = np.asarray(jnp.where(accept, x, residual))
    assert 0.2 < float(accept.mean()) < 0.9  # both branches are exercised
    assert _chi_square_p(np.bincount(emitted, minlength=V), p) > 0.01
    # The draft alone is q's, not p's: the test tells distributions apart at this size.
    assert _chi_square_p(np.bincount(np.asarray(x), minlength=V), p) < 1e-6
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(stream_keys(seeds, pos, ACCEPT_STREAM))
    wrong = np.asarray(jnp.where(u < pp[jnp.arange(N), x], x, residual))
    assert _chi_square_p(np.bincount(wrong, minlength=V), p) < 1e-6


def test_verify_step_rule_emits_the_served_distribution_at_its_first_token():
    """The verify step's glue (``_speculative_sampling``: drafts fed after the last token,
    their q, the accepted count, the emitted token) over 20,000 seeds of one row with K = 2
    drafts from q, the served logits p at every position, temperature 1: the first emitted
    token's counts fit p (p > 0.01), the first draft's do not (p < 1e-6)."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp
    import numpy as np

    from serving.config.engine_config import EngineConfig
    from serving.core.sched.step_plan import DecodeRow, SamplingSettings
    from serving.engine.sample.logits_processors import sample_processed
    from serving.engine.sample.rejection import draft_sample
    from serving.engine.verify_step import VerifyBatch, _speculative_sampling

    V, N, K = 64, 20_000, 2
    cfg = EngineConfig(**TINY_CFG)
    row = DecodeRow("r", 0, 10, tuple(range(1, 4)), SamplingSettings(temperature=1.0), last_token=5,
                    draft_ids=(0, 0))
    batch = jax.tree.map(jnp.asarray, VerifyBatch.from_rows([row], cfg, K))
    T = batch.tokens.shape[0]
    key_p, key_q = jax.random.split(jax.random.PRNGKey(7))
    logits = jnp.broadcast_to(1.5 * jax.random.normal(key_p, (V,)), (T, V))
    q_logits = 1.5 * jax.random.normal(key_q, (V,))
    counts = jnp.zeros((cfg.max_slots, V), jnp.int32)
    state = type("State", (), dict(output_counts=counts, prompt_seen=counts.astype(bool)))
    slots = batch.slot_ids[batch.token_rows]

    def first_token(seed):
        s = dc.replace(batch.sampling, seed=jnp.full(T, seed, jnp.uint32))
        b = dc.replace(batch, sampling=s)
        rs = jax.tree.map(lambda a: a[:2], s)
        x1, q1 = draft_sample(jnp.broadcast_to(q_logits, (2, V)), jnp.full(2, 11), rs)
        x2, q2 = draft_sample(jnp.broadcast_to(q_logits, (2, V)), jnp.full(2, 12), rs)
        tokens = b.tokens.at[1].set(x1[0]).at[2].set(x2[0])
        sampled = sample_processed(logits, b.positions + 1, s, counts, state.prompt_seen, slots)
        q = jnp.stack([q1, q2], axis=1)  # [S, K, V]
        emitted, accepted = _speculative_sampling(logits, tokens, sampled, b, state, slots, q, None)
        return emitted[0], x1[0], accepted[0]

    emitted, x1, accepted = (np.asarray(a) for a in jax.jit(jax.vmap(first_token))(jnp.arange(N)))
    p = np.asarray(jax.nn.softmax(logits[0]))
    assert set(np.unique(accepted)) == {0, 1, 2}
    assert (emitted[accepted > 0] == x1[accepted > 0]).all()
    assert _chi_square_p(np.bincount(emitted, minlength=V), p) > 0.01
    assert _chi_square_p(np.bincount(x1, minlength=V), p) < 1e-6


def test_per_request_opt_out_and_cap(draft_loop, tiny_tokenizer):
    """``num_speculative_tokens``: 0 decodes plainly (a seeded temperature request gets plain
    decoding's ids exactly, no drafts), 1 verifies at most one draft a step (at most two
    tokens an event); a negative one is refused (the gateway's schema and the engine), and
    the field reaches the engine from the HTTP body and over the replica protocol."""
    import pydantic

    from serving.contract.engine_client import RequestRejectedError, SamplingParams
    from serving.gateway.openai.sampling_params import sampling_params
    from serving.gateway.schema.protocol import CompletionRequest
    from serving.rpc.convert import sampling_from_proto, sampling_to_proto
    from tests.support.engine_helpers import request

    def reqs():
        return [request(tiny_prompt(9, 4), max_tokens=20, ignore_eos=True, temperature=1.0, seed=3,
                        num_speculative_tokens=0),
                request(tiny_prompt(7, 2), max_tokens=20, ignore_eos=True, num_speculative_tokens=1)]

    spec, plain = run_both(draft_loop, reqs)
    assert spec[0][0] == plain[0][0] and spec[0][1][-1].num_draft_tokens == 0
    assert spec[1][0] == plain[1][0] and spec[1][1][-1].num_accepted_tokens > 0
    assert max(len(e.token_ids) for e in spec[1][1]) == 2
    with pytest.raises(RequestRejectedError, match="num_speculative_tokens"):
        draft_loop.submit(request([2, 5, 6], max_tokens=2, num_speculative_tokens=-1))
    with pytest.raises(pydantic.ValidationError, match="num_speculative_tokens"):
        CompletionRequest(model="m", prompt="x", num_speculative_tokens=-1)
    body = CompletionRequest(model="m", prompt="x", num_speculative_tokens=2)
    assert sampling_params(body, 4, tiny_tokenizer).num_speculative_tokens == 2
    s = SamplingParams(num_speculative_tokens=2)
    assert sampling_from_proto(sampling_to_proto(s)).num_speculative_tokens == 2
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).num_speculative_tokens is None


def test_per_position_acceptance_and_k_under_load(draft_loop):
    """The engine's per-position counts add up to its totals and fall with the position, the
    scheduler's K of the present load is K up to ``max_batch`` running requests and 0 above,
    and /metrics exposes both."""
    from prometheus_client import generate_latest

    from serving.contract.engine_client import EngineStats
    from serving.core.kv.kv_cache_manager import KVCacheManager
    from serving.core.sched.sched_request import SchedRequest
    from serving.core.sched.scheduler import Scheduler
    from serving.gateway.services.metrics import EngineStatsCollector, GatewayMetrics
    from tests.support.engine_helpers import generate, request

    generate(draft_loop, [request(tiny_prompt(8, 1), max_tokens=20, ignore_eos=True)])
    s = draft_loop.stats()
    drafted, accepted = s.spec_drafted_per_position, s.spec_accepted_per_position
    assert len(drafted) == 3 and sum(drafted) == s.spec_draft_tokens and sum(accepted) == s.spec_accepted_tokens
    assert all(a <= d for a, d in zip(accepted, drafted)) and list(accepted) == sorted(accepted, reverse=True)
    assert s.spec_num_tokens_now == 3  # idle: K

    spec = SpeculativeConfig(method="draft", num_tokens=4, max_batch=2, draft_model="self:int8")
    sched = Scheduler(KVCacheManager(num_pages=32, page_size=4, enable_prefix_caching=False), num_slots=4,
                      token_budget=20, max_prefill_tokens=16, max_prefill_seqs=4, speculative=spec)
    for i in range(3):
        sched.add(SchedRequest(f"r{i}", [1, 2, 3], max_tokens=10))
        sched.schedule()
        assert sched.speculative_tokens_now() == (4 if i < 2 else 0), i

    metrics = GatewayMetrics()
    stats = EngineStats(spec_drafted_per_position=(5, 4), spec_accepted_per_position=(3, 1), spec_num_tokens_now=4)
    metrics.add_engine_collector(EngineStatsCollector(lambda: {"m": lambda: stats}))
    text = generate_latest(metrics.registry).decode()
    for line in ('xlaserve:spec_decode_num_draft_tokens_per_pos_total{model_name="m",position="1"} 4.0',
                 'xlaserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0',
                 'xlaserve:spec_decode_num_speculative_tokens{model_name="m"} 4.0'):
        assert line in text, line


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("min_tokens", [0, 8])
def test_combined_stop_conditions_agree_with_a_draft_model(draft_loop, tiny_tokenizer, ignore_eos, min_tokens):
    """test_speculative.py's pairings of stop, stop_token_ids and max_tokens per ignore_eos x
    min_tokens, with draft-model speculation: every outcome (the seeded ones by speculative
    sampling, not plain decoding's ids) follows the stop rules, and the greedy ones equal
    plain decoding's."""
    from tests.support.stop_agreement import check_with_and_without_speculation, stop_cases

    cases = stop_cases(draft_loop, tiny_tokenizer, tiny_prompt, ignore_eos, min_tokens)
    check_with_and_without_speculation(draft_loop, tiny_tokenizer, cases)
