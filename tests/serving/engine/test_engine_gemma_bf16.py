"""The engine on the real Gemma 3 270M in bfloat16 (the backend policy's batch-invariant
reductions, with the server's default ``--cpu-kernels auto``: on an AMX CPU the output head in
the kernels_cpu AMX kernel; golden continuations, batch invariance across programs,
preemption) and in float32 with the Pallas decode kernel (interpret mode). The float32 loop's
tests: test_engine_gemma.py."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import pytest

from model.gemma3 import Gemma3
from serving.engine.backend_policy import BackendPolicy
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop
from tests.support.engine_helpers import agree_until_near_tie, collect, generate, request
from tests.support.gemma_engine import CFG, make_loop

pytestmark = pytest.mark.gemma


@pytest.fixture(scope="module")
def loop_bf16(gemma_params):
    """bfloat16 serving with the CPU policy's smallest decode bucket (1 row), as ``xlaserve
    serve`` runs: a lone request decodes in a 1-row program, a crowd in the 8-row one, so
    batch invariance is tested across programs, not only across places in one."""
    loop = make_loop(gemma_params, jnp.bfloat16, min_decode_batch=1)
    yield loop
    loop.stop()


def test_bfloat16_reproduces_golden_where_bf16_simulation_did(loop_bf16, golden):
    """Serving dtype bfloat16 (bf16 weights, float32 accumulation): the golden greedy ids wherever
    the reference's bf16 simulation kept the argmax, up to the near-tie cutoff."""
    prompts = [p for p in golden["prompts"] if p["greedy"]["bf16_sim_argmax_agrees"]]
    assert prompts
    outs = generate(loop_bf16, [request(p["ids"], max_tokens=24, ignore_eos=True) for p in prompts])
    for p, ids in zip(prompts, outs):
        agree_until_near_tie(ids, p)


def test_bfloat16_seeded_prompt_alone_equals_twelve_concurrent_copies(loop_bf16, gemma_tokenizer):
    """The issue's request: alone (1-row decode program) and as 12 concurrent copies (8 at a
    time in the 8-row program, 4 more as slots free up): 12 identical texts equal to the lone
    one. The prompt is shorter than a page, so the copies share no cached prefix."""
    ids = gemma_tokenizer.encode("Once upon a time in a small village", add_bos=True)
    assert len(ids) < CFG.page_size
    sampling = dict(max_tokens=12, temperature=1.0, seed=42)
    alone = generate(loop_bf16, [request(ids, **sampling)])[0]
    copies = generate(loop_bf16, [request(ids, **sampling) for _ in range(12)])
    assert len(alone) > 1
    assert copies == [alone] * 12


def test_bfloat16_preempted_crowd_equals_each_request_alone(loop_bf16, golden, gemma_tokenizer):
    """16 concurrent requests (greedy and seeded; 15 prompts of 12-14 tokens cut from the long
    golden prompt, and the issue's seeded story prompt) in a pool the test shrinks to 10 free
    pages by holding the rest itself, with the admission watermark off (host-side settings: the
    same programs, no new pool size). Prompts fit one page and their tokens cross into a second,
    so running requests outgrow the pool, get preempted and are recomputed through prefill
    (prompt and generated tokens in one chunk). Every request's ids equal its run alone."""
    kv, sched = loop_bf16.kv, loop_bf16.scheduler
    assert kv.num_free == CFG.num_pages - 1  # idle: the loop's thread touches pages only while planning
    text = next(p["ids"] for p in golden["prompts"] if p["name"] == "long_repeated_sliding_window")
    cuts = [text[:1] + text[1 + 11 * i:12 + 11 * i + i % 3] for i in range(15)]
    story = gemma_tokenizer.encode("Once upon a time in a small village", add_bos=True)

    def reqs():
        return [request(story, max_tokens=12, temperature=1.0, seed=42)] + [
            request(p, max_tokens=8, ignore_eos=True, **(dict(temperature=1.0, seed=7 + i) if i % 2 else {}))
            for i, p in enumerate(cuts)]

    watermark = sched.watermark_pages
    assert kv.allocate_pages("test-ballast", (CFG.num_pages - 1 - 10) * CFG.page_size)
    sched.watermark_pages = 0
    try:
        async def crowd():
            return await asyncio.gather(*(collect(loop_bf16, r) for r in reqs()))

        runs = asyncio.run(crowd())
        alone = [generate(loop_bf16, [r])[0] for r in reqs()]
    finally:
        sched.watermark_pages = watermark
        kv.free("test-ballast")
    preemptions = [events[-1].num_preemptions for _, events in runs]
    assert sum(preemptions) > 0, "the load did not preempt"
    for i, ((together, _), single) in enumerate(zip(runs, alone)):
        assert together == single, f"request {i} (preempted {preemptions[i]}x): {together} vs alone {single}"


def test_golden_greedy_with_pallas_decode_kernel(gemma_params, golden):
    """attention_impl="pallas": decode runs the Pallas kernel (interpret mode on CPU). Short prompts
    and the 712-token one, whose 24 decode steps span several page blocks of the kernel."""
    import dataclasses

    cfg, params = gemma_params
    pallas = BackendPolicy.for_platform("cpu", attention_impl="pallas")
    loop = EngineLoop(Engine(Gemma3(cfg, params=params, dtype=jnp.float32),
                             dataclasses.replace(CFG, max_slots=4), policy=pallas))
    loop.start(warmup=False)
    try:
        prompts = [p for p in golden["prompts"] if p["name"] in ("english", "code", "long_repeated_sliding_window")]
        assert len(prompts) == 3
        outs = generate(loop, [request(p["ids"], max_tokens=24, ignore_eos=True) for p in prompts])
    finally:
        loop.stop()
    for p, ids in zip(prompts, outs):
        agree_until_near_tie(ids, p)
