"""A self draft's draft vocabulary (``--draft-vocab N``): the settings, which ids it keeps, the
refused cases, int8-served weights drafting with their own layers (no second copy), the
tiny-random engine drafted by its int8 copy through a head of half the vocabulary (the same
greedy ids as without speculation, drafts only among those ids), and speculative sampling's
distribution with a q that is zero outside the draft vocabulary (chi-square, and wrong rules
found different).

The engine sizes are tests/serving/core/test_speculative.py's (its verify row and page buckets);
the Gemma 3 270M goldens with the default draft vocabulary (32768 of 262144 ids) are
tests/serving/core/test_speculative_draft.py's self:int8 test."""

from __future__ import annotations

import pytest

from serving.config.server_config import ServerConfig
from serving.config.speculative_config import SELF_DRAFT_VOCAB, SpeculativeConfig
from tests.serving.core.test_speculative import TINY_CFG, run_both, tiny_prompt
from tests.serving.core.test_speculative_draft import _chi_square_p

HALF = 256
"""The tests' draft vocabulary: the tiny vocabulary's first half (of 512 ids)."""


def test_draft_vocab_settings_and_refusals():
    """N <= 0, a draft vocabulary for another draft model or without a self draft, and N above
    the served vocabulary are clear errors; unset, a self draft gets min(32768, V)."""
    spec = SpeculativeConfig(method="draft", num_tokens=3, draft_model="self:int8")
    assert spec.draft_vocab_for(262144) == SELF_DRAFT_VOCAB == 32768
    assert spec.draft_vocab_for(512) == 512
    sized = SpeculativeConfig(method="draft", num_tokens=3, draft_model="self:int8", draft_vocab=HALF)
    assert sized.draft_vocab_for(512) == HALF
    with pytest.raises(ValueError, match="exceeds the served model's vocabulary of 512"):
        SpeculativeConfig(method="draft", num_tokens=3, draft_model="self:int8", draft_vocab=513).draft_vocab_for(512)
    for kwargs, match in (
            (dict(speculative="draft", num_speculative_tokens=2, draft_model="self:int8", draft_vocab=0), "positive"),
            (dict(speculative="draft", num_speculative_tokens=2, draft_model="self:int8", draft_vocab=-4),
             "positive"),
            (dict(speculative="draft", num_speculative_tokens=2, draft_model="tiny-draft", draft_vocab=64),
             "self drafts"),
            (dict(speculative="ngram", num_speculative_tokens=2, draft_vocab=64), "self drafts"),
            (dict(draft_vocab=64), "--draft-vocab needs")):
        with pytest.raises(ValueError, match=match):
            ServerConfig(**kwargs)


def test_which_ids_a_draft_vocabulary_keeps():
    """The ranked ids first (Gemma 3's: configs/draft_vocab.yaml, its single characters among
    them), then the lowest others, ascending; other vocabularies keep their first N ids."""
    from serving.config.draft_vocab import draft_ids, frequent_ids

    assert draft_ids(10, 4, (9, 3, 12, 7)).tolist() == [0, 3, 7, 9]  # 12 is no id: 0 fills
    assert draft_ids(10, 2, (9, 3, 7)).tolist() == [3, 9]
    assert draft_ids(512, HALF).tolist() == list(range(HALF))
    gemma = frequent_ids("gemma3", 262144)
    assert len(gemma) == 1024 and {236761, 236764, 107} <= set(gemma)  # ".", ",", "\n"
    assert frequent_ids("gemma3", 512) == () and frequent_ids("llama", 262144) == ()
    ids = draft_ids(262144, 32768, gemma)
    assert len(ids) == 32768 and 236761 in ids and (ids[:-1] < ids[1:]).all()
    with pytest.raises(ValueError, match="draft vocabulary of 0 ids"):
        draft_ids(512, 0)


def test_int8_weights_draft_with_their_own_layers_or_are_refused():
    """Int8-served weights draft with those very arrays and only a narrower head (the engine is
    built, nothing runs); with the whole vocabulary (the served model itself) or more ids than
    the model has they are refused when the engine is built. A tied head whose input lookup
    is the same table cannot be cut."""
    import jax.numpy as jnp
    from flax import nnx

    from model.gemma3 import Gemma3
    from serving.config.engine_config import EngineConfig
    from serving.engine.draft_model import head_slice
    from serving.engine.engine import Engine
    from tests.support.tiny_engine import TINY

    model = Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0), quantization="int8")
    spec = SpeculativeConfig(method="draft", num_tokens=3, max_batch=4, draft_model="self:int8", draft_vocab=HALF)
    engine = Engine(model, EngineConfig(**TINY_CFG, speculative=spec))
    served = {path: v.get_value() for path, v in nnx.to_flat_state(engine.params)}
    drafted = {path: v.get_value() for path, v in nnx.to_flat_state(engine.draft.params)}
    assert drafted.keys() == served.keys()
    assert all(drafted[p] is served[p] for p in served if p[0] not in ("embed", "embed_scale"))
    assert drafted[("embed",)].shape == (HALF, TINY.hidden_size) and drafted[("embed_scale",)].shape[0] == HALF
    assert served[("embed",)].shape[0] == drafted[("embed_lookup",)].shape[0] == 512  # inputs: every id
    assert engine.draft.shares_cache and engine.draft.kv is None
    for n, match in ((None, "whole vocabulary"), (512, "whole vocabulary"), (600, "exceeds")):
        spec = SpeculativeConfig(method="draft", num_tokens=3, max_batch=4, draft_model="self:int8", draft_vocab=n)
        with pytest.raises(ValueError, match=match):
            Engine(model, EngineConfig(**TINY_CFG, speculative=spec))
    plain = Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))  # float32, tied: no embed_lookup
    with pytest.raises(ValueError, match="lookup table"):
        head_slice(plain, nnx.state(plain), range(HALF))


@pytest.fixture(scope="module")
def vocab_loop(jax_cache):
    """The tiny-random model served in float32, drafted by its int8 copy with a head of the
    first 256 ids, K = 3 (the served programs are test_speculative_draft.py's); every
    proposal is recorded."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from model.gemma3 import Gemma3
    from serving.engine.engine import Engine, EngineConfig
    from serving.runtime.engine_loop import EngineLoop
    from tests.support.tiny_engine import TINY

    spec = SpeculativeConfig(method="draft", num_tokens=3, max_batch=4, draft_model="self:int8", draft_vocab=HALF)
    engine = Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), EngineConfig(**TINY_CFG, speculative=spec))
    proposed = []
    propose = engine.draft.propose

    def recording(batch, served_kv=None):
        kv, drafts, q = propose(batch, served_kv)
        q = np.asarray(q)
        proposed.append((np.asarray(drafts), np.asarray(batch.cu_q_lens), int(batch.num_seqs),
                         float(np.abs(q[..., HALF:]).max()), q[..., :HALF].sum(-1).max()))
        return kv, drafts, q

    engine.draft.propose = recording
    loop = EngineLoop(engine)
    loop.start(warmup=False)
    yield loop, proposed
    loop.stop()


def test_a_draft_vocabulary_keeps_greedy_outputs(vocab_loop):
    """Three greedy prompts and a seeded temperature one together: the greedy ids with the
    draft vocabulary are those without speculation, drafts accepted and rejected (the served
    argmax is past id 255 about half the time on this random model), every draft a row asked
    for among the first 256 ids, and the distributions q the propose step hands the verify step
    zero past them (summing to 1 within them for the temperature row)."""
    from tests.support.engine_helpers import request

    loop, proposed = vocab_loop
    before = loop.stats()
    spec, plain = run_both(loop, lambda: [request(tiny_prompt(5 + 3 * i, i), max_tokens=20, ignore_eos=True,
                                                  **(dict(temperature=1.0, seed=5) if i == 3 else {}))
                                          for i in range(4)])
    for i, ((ids_s, _), (ids_p, _)) in enumerate(zip(spec, plain)):
        assert ids_s == ids_p or i == 3, i
        assert len(ids_s) == 20
    after = loop.stats()
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert 0 < accepted < drafts
    asked = [d[r, :cu[r + 1] - cu[r] - 1] for d, cu, rows, _, _ in proposed for r in range(rows)]
    assert sum(a.size for a in asked) >= drafts > 0
    assert max(int(a.max()) for a in asked if a.size) < HALF
    assert max(outside for *_, outside, _ in proposed) == 0.0
    assert abs(max(inside for *_, inside in proposed) - 1.0) < 1e-5  # the temperature row's q


def test_speculative_sampling_with_a_draft_vocabulary_emits_the_served_distribution():
    """20,000 first tokens of one temperature row: drafts drawn from a draft head over 40 of 64
    ids (scattered, as Gemma's draft vocabulary is), q placed over the 64 with zeros elsewhere by
    ``full_vocab`` (as the propose step does), accepted with min(1, p/q), else the residual
    sample: their counts fit p (p > 0.01), tokens outside the draft vocabulary included, while
    two wrong rules are found different (p < 1e-6): accepting with probability p(x)
    (forgetting q), and a residual kept within the draft vocabulary."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from serving.engine.draft_model import full_vocab
    from serving.engine.sample.rejection import (ACCEPT_STREAM, RESIDUAL_STREAM, accept_and_residual,
                                                 draft_sample, stream_keys)
    from serving.engine.sample.sampling import SamplingArrays

    V, Nd, N = 64, 40, 20_000
    key_p, key_q, key_ids = jax.random.split(jax.random.PRNGKey(461), 3)
    ids = jnp.sort(jax.random.permutation(key_ids, V)[:Nd]).astype(jnp.int32)
    p_logits = 1.5 * jax.random.normal(key_p, (V,))
    q_logits = p_logits[ids] + 0.8 * jax.random.normal(key_q, (Nd,))  # a draft close to p, on 40 ids
    p = np.asarray(jax.nn.softmax(p_logits))
    outside = np.ones(V, bool)
    outside[np.asarray(ids)] = False
    assert 0.15 < p[outside].sum() < 0.6  # mass the draft can never propose
    seeds = jnp.arange(N, dtype=jnp.uint32)
    pos = jnp.full((N,), 9, jnp.int32)
    s = SamplingArrays(jnp.ones(N), jnp.zeros(N, jnp.int32), jnp.ones(N), seeds)
    j, q_small = draft_sample(jnp.broadcast_to(q_logits, (N, Nd)), pos, s)
    x = ids[j]
    q = full_vocab(q_small, V, ids)
    assert q.shape == (N, V) and float(jnp.abs(q[:, outside]).max()) == 0.0
    assert np.allclose(np.asarray(q[0, ids]), np.asarray(jax.nn.softmax(q_logits)), atol=1e-6)
    pp = jnp.broadcast_to(jnp.asarray(p), (N, V))
    akeys, rkeys = stream_keys(seeds, pos, ACCEPT_STREAM), stream_keys(seeds, pos, RESIDUAL_STREAM)
    accept, residual = accept_and_residual(pp, q, x, akeys, rkeys)
    emitted = np.asarray(jnp.where(accept, x, residual))
    assert 0.3 < float(accept.mean()) < 0.95 and outside[emitted].mean() > 0.1
    assert _chi_square_p(np.bincount(emitted, minlength=V), p) > 0.01
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(akeys)
    wrong = np.asarray(jnp.where(u < pp[jnp.arange(N), x], x, residual))  # forgets q
    assert _chi_square_p(np.bincount(wrong, minlength=V), p) < 1e-6
    inside = jnp.where(jnp.asarray(outside), 0.0, pp)  # the residual of p restricted to the draft's ids
    _, wrong_residual = accept_and_residual(inside / inside.sum(-1, keepdims=True), q, x, akeys, rkeys)
    wrong = np.asarray(jnp.where(accept, x, wrong_residual))
    assert _chi_square_p(np.bincount(wrong, minlength=V), p) < 1e-6
