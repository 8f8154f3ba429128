"""Shared pieces of the benchmarks: build an engine, time one request's events, a free port."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from serving.contract.engine_client import EngineRequest, SamplingParams


def build_engine(model: str, dtype: str = "float32", **engine_overrides):
    """(Engine, tokenizer) with the server's defaults, overridden by engine_overrides."""
    from serving.config.engine_config import EngineConfig
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.engine.engine import Engine
    from serving.loading.model_registry import load_model

    enable_compilation_cache()
    m, tok = load_model(model, dtype=dtype, progress=False)
    cfg = dict(max_slots=32, num_pages=2048, max_model_len=min(8192, m.cfg.max_position),
               min_decode_batch=1)
    cfg.update(engine_overrides)
    return Engine(m, EngineConfig(**cfg)), tok


async def timed_request(loop, rid: str, prompt: list[int], max_tokens: int, **kw):
    """Runs one greedy request; returns (TTFT s, [token arrival times], last event)."""
    t0 = time.perf_counter()
    times, last = [], None
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True), **kw)
    async for ev in loop.submit(req):
        now = time.perf_counter()
        times += [now] * len(ev.token_ids)
        last = ev
    return times[0] - t0, times, last


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def cli_module(source_tree: Path) -> str:
    """The module ``python -m`` runs as the ``xlaserve`` command of ``source_tree``:
    ``serving.cli.main``, or ``serving.cli`` in a tree from before the packages by layer (so a
    benchmark can still start a server of an older ref)."""
    return "serving.cli.main" if (Path(source_tree) / "serving" / "cli" / "main.py").is_file() else "serving.cli"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a server the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
