"""The disk KV tier in the engine loop (tiny-random, float32, the host tier tests' shape): a
restarted loop finds its prefixes on disk and serves the same tokens, tenants never share
pages, corrupt and foreign files are skipped while the request answers, host-tier evictions
spill to disk and come back, and the disk full drops pages without failing a request."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from serving.core.kv import disk_kv_store
from serving.core.kv.kv_cache_manager import prompt_page_hashes
from tests.support.disk_full import no_space_on_write
from tests.support.engine_helpers import collect, request
from tests.support.tiny_engine import prompt

A = prompt(41, 5)  # 5 full pages of 8 tokens, then one more
A_KEYS = prompt_page_hashes(A, 8, None)
SAMPLED = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def engine(jax_cache):
    """One engine for the module (a restart is a new loop and page manager over it: the
    device pool's old contents are unknown to them)."""
    import jax.numpy as jnp
    from flax import nnx

    from model.gemma3 import Gemma3
    from serving.engine.engine import Engine, EngineConfig
    from tests.support.tiny_engine import TINY

    cfg = EngineConfig(max_slots=4, num_pages=13, max_model_len=96, page_size=8, prefill_chunk=32,
                       min_decode_batch=2)
    return Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), cfg)


def disk_loop(engine, d, host_bytes: int = 1 << 24, max_bytes: int = 1 << 26, **kw):
    from serving.runtime.engine_loop import EngineLoop

    lp = EngineLoop(engine, host_kv_cache_bytes=host_bytes, kv_disk_dir=str(d), kv_disk_max_bytes=max_bytes, **kw)
    lp.start(warmup=False)
    return lp


def run(lp, ids, salt=None, **sampling):
    req = request(ids, **{**SAMPLED, **sampling})
    return asyncio.run(collect(lp, dataclasses.replace(req, cache_salt=salt)))


def page_path(lp, ids, i, salt=None):
    return lp.disk_kv.path(prompt_page_hashes(ids, 8, salt)[i])


def test_a_restarted_loop_serves_its_old_prefix_from_disk_and_tenants_never_share(engine, tmp_path):
    first = disk_loop(engine, tmp_path)
    try:
        want, ev = run(first, A, salt="tenant-1")
        assert ev[-1].cached_tokens == 0
    finally:
        first.stop()  # every cached page to disk
    assert first.disk_kv.stores >= 5 and all(os.path.exists(page_path(first, A, i, "tenant-1")) for i in range(5))
    plans = []
    again = disk_loop(engine, tmp_path)
    again.on_step = plans.append
    try:
        assert len(again.disk_kv) == first.disk_kv.stores  # the index rebuilt from the files
        other_ids, other = run(again, A, salt="tenant-2")  # another tenant: no hit
        assert (other[-1].cached_tokens, other[-1].disk_cached_tokens, again.disk_kv.hits) == (0, 0, 0)
        n = len(plans)
        got, ev = run(again, A, salt="tenant-1")
        stats = again.stats()
    finally:
        again.stop()
    assert got == want == other_ids
    assert (ev[-1].cached_tokens, ev[-1].host_cached_tokens, ev[-1].disk_cached_tokens) == (40, 40, 40)
    rows = [r for p in plans[n:] for r in p.prefill]
    assert rows[0].start == 40 and sum(len(r.token_ids) for r in rows) == 1  # only the last prompt token
    assert stats.disk_kv_hits == 5 and stats.disk_kv_reads == 5 and stats.disk_kv_read_seconds > 0
    assert stats.disk_kv_bytes_read == 5 * os.path.getsize(page_path(again, A, 0, "tenant-1"))


def test_corrupt_and_foreign_files_are_skipped_and_the_request_answers(engine, tmp_path):
    first = disk_loop(engine, tmp_path)
    try:
        want, _ = run(first, A)
    finally:
        first.stop()
    files = len(os.listdir(tmp_path))
    foreign = disk_loop(engine, tmp_path, kv_disk_model_id="another model")  # (sharing the directory)
    try:
        assert foreign.disk_kv.foreign_files == files and len(foreign.disk_kv) == 0
        got, ev = run(foreign, A)
    finally:
        foreign.stop()
    assert got == want and ev[-1].disk_cached_tokens == ev[-1].cached_tokens == 0
    assert len(os.listdir(tmp_path)) == 2 * files  # its own pages, beside the first loop's
    with open(page_path(first, A, 2), "r+b") as f:  # page 2's payload damaged
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    again = disk_loop(engine, tmp_path)
    try:  # two choices of one prompt (n=2, one seed): the second waits for the same disk pages
        parent = request(A, **SAMPLED)
        child = dataclasses.replace(request(A, **SAMPLED), parent_id=parent.request_id)

        async def both():
            return await asyncio.gather(collect(again, parent), collect(again, child))

        (got, ev), (got_child, ev_child) = asyncio.run(both())
        stats = again.stats()
    finally:
        again.stop()
    assert got == got_child == want
    assert ev[-1].disk_cached_tokens == ev[-1].cached_tokens == 16  # pages 0 and 1; the rest recomputed
    assert ev_child[-1].disk_cached_tokens == 16 and stats.disk_kv_hits == 2  # read once, for both
    assert stats.disk_kv_corrupt_files == 1 and stats.disk_kv_foreign_files == files
    assert again.disk_kv.stores >= 1 and os.path.exists(page_path(first, A, 2))  # recomputed, saved at stop


def test_host_evictions_spill_to_disk_and_the_disk_full_fails_no_request(engine, tmp_path, monkeypatch):
    k = engine.state.kv_cache.k
    host_bytes = 5 * 2 * k[:, :, 0].size * k.dtype.itemsize  # 5 pages: A's prefix, staged for its reload
    lp = disk_loop(engine, tmp_path, host_bytes=host_bytes)
    try:
        want, _ = run(lp, A)
        run(lp, prompt(90, 3), max_tokens=4)  # all 12 pages: A's 5 leave the device for the host tier
        assert lp.disk_kv.stores == 0 and A_KEYS[0] in lp.host_kv
        run(lp, prompt(90, 4), max_tokens=4)  # and the 11 of this prompt push them down to disk
        lp.disk_kv.flush()
        assert all(key in lp.disk_kv and key not in lp.host_kv for key in A_KEYS)
        got, ev = run(lp, A)
    finally:
        lp.stop()
    assert got == want and ev[-1].cached_tokens == ev[-1].disk_cached_tokens == 40

    no_space_on_write(monkeypatch, disk_kv_store)
    d = tmp_path / "full"
    lp = disk_loop(engine, d, host_bytes=host_bytes)
    try:
        got, ev = run(lp, A)
        run(lp, prompt(90, 3), max_tokens=4)
        run(lp, prompt(90, 4), max_tokens=4)
        again, ev2 = run(lp, A)
    finally:
        lp.stop()
    assert got == again == want and ev[-1].finish_reason == ev2[-1].finish_reason == "length"
    assert lp.disk_kv.dropped_pages >= 3 and lp.disk_kv.stores == 0 and os.listdir(d) == []
    assert lp.stats().disk_kv_dropped_pages >= 3


def test_disk_counters_reach_metrics_the_wire_and_the_trace():
    from prometheus_client import CollectorRegistry, generate_latest

    from serving.contract.engine_client import EngineStats, TokenEvent
    from serving.gateway.services.metering import cached_by_tier
    from serving.gateway.services.metrics import EngineStatsCollector
    from serving.rpc import convert

    ev = TokenEvent("r", (1,), prompt_tokens=50, cached_tokens=48, host_cached_tokens=40, disk_cached_tokens=32)
    back = convert.event_from_proto("r", convert.event_to_proto(ev).tokens)
    assert (back.cached_tokens, back.host_cached_tokens, back.disk_cached_tokens) == (48, 40, 32)
    assert cached_by_tier(48, 40, 32) == {"device": 8, "host": 8, "disk": 32}
    assert cached_by_tier(16, 40, 0) == {"device": 0, "host": 16, "disk": 0}  # (reloads after a preemption)
    s = EngineStats(host_kv_capacity_bytes=1 << 20, disk_kv_hits=5, disk_kv_stores=7, disk_kv_evictions=2,
                    disk_kv_usage_bytes=4096, disk_kv_capacity_bytes=1 << 30, disk_kv_bytes_read=1000,
                    disk_kv_bytes_written=1400, disk_kv_read_seconds=0.25, disk_kv_reads=5,
                    disk_kv_corrupt_files=1, disk_kv_foreign_files=3, disk_kv_dropped_pages=4)
    assert convert.load_from_proto(convert.load_to_proto(s)) == s
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(lambda: {"m": lambda: s}))
    text = generate_latest(reg).decode()
    for line in ('xlaserve:disk_kv_cache_hits_total{model_name="m"} 5.0',
                 'xlaserve:disk_kv_cache_stores_total{model_name="m"} 7.0',
                 'xlaserve:disk_kv_cache_evictions_total{model_name="m"} 2.0',
                 'xlaserve:disk_kv_cache_dropped_pages_total{model_name="m"} 4.0',
                 'xlaserve:disk_kv_cache_read_bytes_total{model_name="m"} 1000.0',
                 'xlaserve:disk_kv_cache_written_bytes_total{model_name="m"} 1400.0',
                 'xlaserve:disk_kv_cache_usage_bytes{model_name="m"} 4096.0',
                 'xlaserve:disk_kv_cache_ignored_files_total{model_name="m",why="corrupt"} 1.0',
                 'xlaserve:disk_kv_cache_ignored_files_total{model_name="m",why="foreign"} 3.0',
                 'xlaserve:disk_kv_cache_read_seconds_count{model_name="m"} 5.0',
                 'xlaserve:disk_kv_cache_read_seconds_sum{model_name="m"} 0.25'):
        assert line in text, line


def test_a_disk_tier_needs_the_host_tier_and_a_bound(engine, tmp_path):
    from serving.config.server_config import ServerConfig
    from serving.runtime.engine_loop import EngineLoop

    with pytest.raises(ValueError, match="host_kv_cache_gib > 0"):
        ServerConfig(kv_disk_dir=str(tmp_path), kv_disk_max_bytes=1 << 30)
    with pytest.raises(ValueError, match="kv_disk_max_bytes > 0"):
        ServerConfig(kv_disk_dir=str(tmp_path), host_kv_cache_gib=1)
    with pytest.raises(ValueError, match="needs kv_disk_dir"):
        ServerConfig(kv_disk_max_bytes=1 << 30)
    assert ServerConfig(kv_disk_dir=str(tmp_path), kv_disk_max_bytes=1, host_kv_cache_gib=1).kv_disk_max_bytes == 1
    with pytest.raises(ValueError, match="under the host tier"):
        EngineLoop(engine, kv_disk_dir=str(tmp_path), kv_disk_max_bytes=1 << 20)
