"""Logs every XLA compile of every Python process of a test run, for the suite's budget
(docs/design/testing.md, "Where the time goes").

Put this folder first on PYTHONPATH and name an output folder::

    PYTHONPATH=tests/support/compile_log XLASERVE_COMPILE_LOG=/tmp/compiles bash .ci/run
    python -m tests.support.compile_report /tmp/compiles

Each process that imports JAX appends one line per event of ``jax.monitoring`` (trace, lowering
and backend-compile durations in seconds, with the jitted function's name; persistent-cache hits
and misses, with the module's name and cache key from JAX's compiler log) to
``$XLASERVE_COMPILE_LOG/<pid>.tsv``, with the pytest test that was running
(``PYTEST_CURRENT_TEST``, which server processes inherit from the test that started them).
Columns: test, event, seconds, detail (function name, or ``module key`` for the cache), argv.
Lines are written as they happen, so a server killed by a signal keeps its log.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

OUT = os.environ.get("XLASERVE_COMPILE_LOG")


def _install() -> None:
    import logging

    from jax._src import monitoring

    log = open(os.path.join(OUT, f"{os.getpid()}.tsv"), "a", buffering=1)
    argv = " ".join(sys.orig_argv)[:200].replace("\t", " ")

    def write(event: str, seconds: float, detail: str = "") -> None:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-")
        log.write(f"{test}\t{event}\t{seconds:.4f}\t{detail.replace(chr(9), ' ')}\t{argv}\n")

    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: write(event, duration, str(kw.get("fun_name", ""))))
    monitoring.register_event_listener(lambda event, **_: write(event, 0.0))

    def cache_lookups(record: logging.LogRecord) -> bool:
        """JAX's compiler logs each persistent-cache hit and miss at DEBUG with the module's
        name and cache key (which program compiled, and whether another process compiled it
        first). Recorded here; the logger's DEBUG lines go no further than before."""
        text = str(record.msg)
        if "PERSISTENT COMPILATION CACHE MISS" in text or "Persistent compilation cache hit" in text:
            kind = "miss" if "MISS" in text else "hit"
            write(f"/xlaserve/cache_{kind}", 0.0, f"{record.args[0]} {record.args[1]}")
        return record.levelno >= logging.WARNING

    compiler_log = logging.getLogger("jax._src.compiler")
    compiler_log.addFilter(cache_lookups)
    compiler_log.setLevel(logging.DEBUG)


class _AfterMonitoringImport(importlib.abc.MetaPathFinder):
    """Registers the listeners right after ``jax._src.monitoring`` is first imported, so a
    process that never imports JAX pays nothing."""

    def find_spec(self, name, path, target=None):
        if name != "jax._src.monitoring":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _install()

        spec.loader.exec_module = exec_module
        return spec


if OUT:
    os.makedirs(OUT, exist_ok=True)
    sys.meta_path.insert(0, _AfterMonitoringImport())
