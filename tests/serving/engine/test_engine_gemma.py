"""The engine on the real Gemma 3 270M in float32: golden greedy continuations, batch
invariance, logprobs and a remote replica (bfloat16 and the Pallas decode kernel:
test_engine_gemma_bf16.py, a file of its own so that two test workers share the Gemma tests)."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import pytest

from tests.support.engine_helpers import agree_until_near_tie, collect, generate, request
from tests.support.gemma_engine import make_loop

pytestmark = pytest.mark.gemma


@pytest.fixture(scope="module")
def loop_f32(gemma_params):
    loop = make_loop(gemma_params, jnp.float32)
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def batched_f32(loop_f32, golden):
    """The 8 golden prompts' greedy ids, all 8 submitted at once (one decode batch), float32."""
    return generate(loop_f32, [request(p["ids"], max_tokens=24, ignore_eos=True) for p in golden["prompts"]])


def test_golden_greedy_batched(batched_f32, golden):
    for p, ids in zip(golden["prompts"], batched_f32):
        agree_until_near_tie(ids, p)


ALONE = ("code", "json", "emoji", "long_repeated_sliding_window")
"""The prompts run alone against their batched ids (each alone run is 24 decode steps of its own):
three short ones whose 24 steps have no near tie, and the 712-token one (chunked prefill, past
the sliding window)."""


def test_batch_invariance_greedy(loop_f32, batched_f32, golden):
    """Each prompt alone gives the ids it gives alongside 7 others of different lengths."""
    prompts = golden["prompts"]
    for p, together in zip(prompts, batched_f32):
        if p["name"] not in ALONE:
            continue
        alone = generate(loop_f32, [request(p["ids"], max_tokens=24, ignore_eos=True)])[0]
        margins = p["greedy"]["step_top1_top2_margin"]
        for step, (a, b) in enumerate(zip(alone, together)):
            if margins[step] < 1e-2:
                break
            assert a == b, f"{p['name']} step {step}: alone {a}, batched {b}"


def test_seeded_sample_is_batch_invariant(loop_f32, golden):
    prompts = golden["prompts"]
    sampling = dict(max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    target = prompts[0]["ids"]
    alone = generate(loop_f32, [request(target, **sampling)])[0]
    others = [request(p["ids"], max_tokens=16, temperature=1.0, seed=7 + i, ignore_eos=True)
              for i, p in enumerate(prompts[1:])]
    together = generate(loop_f32, others[:3] + [request(target, **sampling)] + others[3:])[3]
    assert alone == together
    again = generate(loop_f32, [request(target, **sampling)])[0]
    assert again == alone
    other_seed = generate(loop_f32, [request(target, **{**sampling, "seed": 99})])[0]
    assert other_seed != alone


def test_golden_top5_logprobs_via_prompt_logprobs_and_the_first_token(loop_f32, golden):
    """Top-5 log probabilities at every recorded position equal ``top5_logits - logsumexp``
    (5e-3, by token id): earlier positions through prompt logprobs (echo), the last through
    the first generated token's entry. All 8 prompts: the prompt-logprobs prefill compiles for
    the token buckets 16, 32 and 256 (the 712-token prompt in chunks of 256)."""
    prompts = golden["prompts"]
    reqs = [request(p["ids"], max_tokens=1, ignore_eos=True, logprobs=5, prompt_logprobs=5) for p in prompts]

    async def main():
        return await asyncio.gather(*(collect(loop_f32, r) for r in reqs))

    for p, (ids, events) in zip(prompts, asyncio.run(main())):
        first = events[0]
        assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == p["num_tokens"]
        for rec in p["positions"]:
            entry = first.logprobs[0] if rec["is_last"] else first.prompt_logprobs[rec["pos"] + 1]
            ours = dict(entry.top)
            lse = rec["logit_stats"]["logsumexp"]
            for j, (tok, logit) in enumerate(zip(rec["top5_ids"], rec["top5_logits"])):
                if tok in ours:
                    assert abs(ours[tok] - (logit - lse)) < 5e-3, (p["name"], rec["pos"], tok)
                else:  # only the 5th may swap with a near-tied 6th
                    assert j == 4 and logit - (min(ours.values()) + lse) < 1e-2, (p["name"], rec["pos"])
            if not rec["is_last"]:
                assert entry.token_id == p["ids"][rec["pos"] + 1]


def test_golden_greedy_through_a_remote_replica(loop_f32, golden, gemma_tokenizer):
    """The float32 engine behind the gRPC engine service on loopback, called through the
    router as ``serve --engines`` does: the 8 golden prompts' greedy ids as in process, and
    the gateway's completion text, with the tokenizer rebuilt from the replica's files."""
    import httpx

    from model.tokenizer_files import tokenizer_from_files
    from serving.gateway.app import ServedModel, create_app
    from serving.replica.engine_service import EngineService, model_info, start_server
    from serving.routing.router import Router
    from serving.rpc.remote_engine import RemoteEngine

    info = model_info(loop_f32, "gemma-3-270m", gemma_tokenizer)
    english = next(p for p in golden["prompts"] if p["name"] == "english")

    async def main():
        server, port = await start_server(EngineService(loop_f32, info), "127.0.0.1", 0)
        router = Router([RemoteEngine(f"grpc://127.0.0.1:{port}", info, probe_interval=0.05)])
        await router.open()
        try:
            await router.wait_until_up()
            reqs = [request(p["ids"], max_tokens=24, ignore_eos=True) for p in golden["prompts"]]
            outs = await asyncio.gather(*(collect(router, r) for r in reqs))
            tokenizer = tokenizer_from_files(dict(info.tokenizer_files))
            app = create_app({"gemma-3-270m": ServedModel("gemma-3-270m", router, tokenizer,
                                                         router.max_model_len)})
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json={"model": "gemma-3-270m", "prompt": english["text"],
                                                          "max_tokens": 24, "temperature": 0})
            return [ids for ids, _ in outs], [evs[-1] for _, evs in outs], r.json(), router.replicas[0].url
        finally:
            await router.close()
            await server.stop(grace=None)

    ids, lasts, body, url = asyncio.run(main())
    for p, got in zip(golden["prompts"], ids):
        agree_until_near_tie(got, p)
    assert {ev.replica for ev in lasts} == {url}
    assert body["choices"][0]["text"] == english["greedy"]["text"]
    assert body["usage"]["prompt_tokens"] == english["num_tokens"]
