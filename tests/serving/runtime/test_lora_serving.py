"""Serving LoRA adapters through the engine loop (tests/data/lora_tiny over hf_tiny's Llama):
mixed batches of base and adapter requests, slots shared by more adapters than fit, the
prefix cache never shared across adapters (nor with weights reloaded under the same name),
unloading refused under a running request, and the model-server protocol's metrics scraped
as requests wait, run and finish."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model.factory import build_model
from model.safetensors_loader import load_hf_checkpoint
from serving.config.engine_config import EngineConfig
from serving.contract.engine_client import RequestRejectedError
from serving.engine.engine import Engine
from serving.engine.lora_registry import LoraInUseError
from serving.gateway.services.metrics import GatewayMetrics
from serving.runtime.engine_loop import EngineLoop
from tests.support.engine_helpers import collect, request
from tests.support.hf_tiny_parity import agree_until_near_tie, golden
from tests.support.paths import TEST_DATA

LORA = TEST_DATA / "lora_tiny"
ADAPTERS = {"a4": LORA / "llama_r4", "a8": LORA / "llama_r8", "rs8": LORA / "llama_rs8"}
CFG = EngineConfig(max_slots=16, num_pages=160, max_model_len=64, page_size=8, prefill_chunk=64,
                   min_decode_batch=4, kv_dtype="float32", max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def engine(jax_cache):
    cfg, params = load_hf_checkpoint(TEST_DATA / "hf_tiny" / "llama", progress=False)
    return Engine(build_model(cfg, params=params, dtype=jnp.float32), CFG)


def _loop(engine, modules=("a4", "a8")):
    loop = EngineLoop(engine, lora_modules={m: str(ADAPTERS[m]) for m in modules})
    loop.start(warmup=False)
    return loop


def _req(prompt, lora=None, n=8):
    return dataclasses.replace(request(prompt, max_tokens=n, ignore_eos=True), lora_name=lora)


def _run(loop, reqs):
    async def main():
        return await asyncio.gather(*(collect(loop, r) for r in reqs))
    return asyncio.run(main())


def test_mixed_batch_gives_each_request_its_ids_alone(engine):
    """16 concurrent requests over the base model and two adapters of ranks 4 and 8: each
    gets the greedy ids it gets alone, and the adapters' are PEFT's."""
    ref = golden("llama")
    rng = np.random.default_rng(0)
    names = [None, "a4", "a8"]
    reqs = [_req(ref["prompt"] if i < 3 else rng.integers(3, 250, 5 + i).tolist(), names[i % 3],
                 n=12 if i < 3 else 8) for i in range(16)]
    loop = _loop(engine)
    try:
        alone = [_run(loop, [r])[0][0] for r in reqs]
        together = _run(loop, [dataclasses.replace(r, request_id=r.request_id + "-b") for r in reqs])
    finally:
        loop.stop()
    assert [ids for ids, _ in together] == alone
    assert agree_until_near_tie(alone[0], ref, "base") >= 6
    for i, kind in ((1, "r4"), (2, "r8")):
        peft = json.loads((LORA / f"llama_{kind}" / "golden.json").read_text())
        assert agree_until_near_tie(alone[i], peft, f"engine llama_{kind}") >= 6
    assert len({tuple(alone[i]) for i in range(3)}) == 3  # the adapters change the output


def test_more_adapters_than_slots_wait_and_match(engine):
    """Three adapters over two device slots, requests of all three at once: each completes
    with its adapter's ids (a request waits while the slots are pinned by others)."""
    prompt = golden("llama")["prompt"]
    loop = _loop(engine, modules=("a4", "a8", "rs8"))
    try:
        alone = {m: _run(loop, [_req(prompt, m)])[0][0] for m in ADAPTERS}
        mixed = _run(loop, [_req(prompt, m) for m in ("a4", "a8", "rs8", "a8", "rs8", "a4")])
        loads = loop.lora.registry.loads
    finally:
        loop.stop()
    assert [ids for ids, _ in mixed] == [alone[m] for m in ("a4", "a8", "rs8", "a8", "rs8", "a4")]
    assert loads >= 4  # three adapters in two slots: at least one written twice


def test_prefix_cache_is_not_shared_across_adapters_or_reloads(engine, tmp_path):
    prompt = list(range(3, 35))  # 4 full pages

    def cached(loop, lora):
        ids, events = _run(loop, [_req(prompt, lora, n=2)])[0]
        return events[-1].cached_tokens, ids

    loop = _loop(engine)
    try:
        assert cached(loop, "a4")[0] == 0
        assert cached(loop, "a4")[0] > 0  # the cache works for the same adapter
        assert cached(loop, "a8")[0] == 0
        assert cached(loop, None)[0] == 0
        # other weights under the same name: no stale page
        changed = tmp_path / "a4"
        shutil.copytree(ADAPTERS["a4"], changed)
        tensors = load_file(str(changed / "adapter_model.safetensors"))
        save_file({k: v * np.float32(1.5) if "lora_B" in k else v for k, v in tensors.items()},
                  str(changed / "adapter_model.safetensors"))
        old = loop.lora.registry.digest("a4")
        asyncio.run(loop.unload_lora("a4"))
        with pytest.raises(RequestRejectedError, match="not loaded"):
            loop.submit(_req(prompt, "a4"))
        asyncio.run(loop.load_lora("a4", str(changed)))
        assert loop.lora.registry.digest("a4") != old
        assert cached(loop, "a4")[0] == 0
        assert cached(loop, "a4")[0] > 0
    finally:
        loop.stop()


def test_unload_refused_while_a_request_runs(engine):
    loop = _loop(engine)

    async def main():
        stream = loop.submit(_req(list(range(5, 21)), "a8", n=40))
        first = await stream.__anext__()
        with pytest.raises(LoraInUseError):
            await loop.unload_lora("a8")
        rest = [ev async for ev in stream]
        await loop.unload_lora("a8")
        with pytest.raises(KeyError):
            await loop.unload_lora("a8")
        with pytest.raises(ValueError, match="already loaded"):
            await loop.load_lora("a4", str(ADAPTERS["a4"]))
        return [first] + rest

    try:
        events = asyncio.run(main())
        assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 40
        assert loop.lora_names() == ["a4"]
    finally:
        loop.stop()


def test_lora_is_refused_for_a_mixture_of_experts_with_the_reason(jax_cache):
    from flax import nnx

    from model.config import ModelConfig
    from serving.loading.model_registry import known_models

    cfg = ModelConfig.from_dict(known_models()["tiny-moe"]["config"])
    with pytest.raises(ValueError, match="mixture of experts"):
        Engine(build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32), CFG)


def _scrape(metrics: GatewayMetrics) -> dict[str, tuple[dict, float]]:
    """The protocol's series of a /metrics scrape: name -> (labels, value)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            if s.name in ("xlaserve:num_requests_waiting", "xlaserve:num_requests_running",
                          "xlaserve:kv_cache_usage_perc", "xlaserve:lora_requests_info"):
                assert s.name not in out or s.name == "xlaserve:num_requests_waiting" or s.labels.get(
                    "model_name") != out[s.name][0].get("model_name")
                out.setdefault(s.name, (s.labels, s.value))
    return out


def test_model_server_protocol_metrics_move(engine):
    """The Kubernetes inference gateway's metrics, scraped as the gateway's /metrics renders
    them (one base model and its adapters over one loop): queued and running requests,
    KV-cache use (0..1), and the LoRA info series (adapters of running requests, of waiting
    ones, max_lora), as three adapters' requests share two slots, then finish."""
    from serving.gateway.services.metrics import EngineStatsCollector

    loop = _loop(engine, modules=("a4", "a8", "rs8"))
    metrics = GatewayMetrics()
    metrics.add_engine_collector(EngineStatsCollector(lambda: {"base": loop.stats, "a4": loop.stats}))

    async def main():
        await loop.ping()
        idle = _scrape(metrics)
        streams = [loop.submit(_req(list(range(5, 21)), m, n=40)) for m in ("a4", "a8", "rs8")]
        firsts = [await s.__anext__() for s in streams[:2]]  # a4 and a8 hold the two slots
        await loop.ping()
        busy = _scrape(metrics)
        rest = [[ev async for ev in s] for s in streams]
        await loop.ping()
        return idle, firsts, busy, rest, _scrape(metrics)

    try:
        idle, firsts, busy, rest, done = asyncio.run(main())
    finally:
        loop.stop()
    assert idle["xlaserve:num_requests_running"][1] == idle["xlaserve:num_requests_waiting"][1] == 0
    assert idle["xlaserve:lora_requests_info"][0] == {
        "max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert busy["xlaserve:num_requests_running"][1] == 2 and busy["xlaserve:num_requests_waiting"][1] == 1
    assert 0 < busy["xlaserve:kv_cache_usage_perc"][1] <= 1
    labels, stamp = busy["xlaserve:lora_requests_info"]
    assert labels == {"max_lora": "2", "running_lora_adapters": "a4,a8", "waiting_lora_adapters": "rs8"}
    assert stamp > 1.7e9  # the scrape's Unix time
    assert all(r[-1].finish_reason == "length" for r in rest)
    assert done["xlaserve:num_requests_running"][1] == done["xlaserve:num_requests_waiting"][1] == 0
    assert done["xlaserve:lora_requests_info"][0]["running_lora_adapters"] == ""
