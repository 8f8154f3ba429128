"""Starting a real `xlaserve serve` process on loopback for tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

TINY_SERVER_ARGS = ["--model", "tiny-random", "--max-model-len", "512", "--max-slots", "4",
                    "--num-pages", "256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(serve_args: list[str], log_path: Path, timeout_s: float = 240, log_level: str = "WARNING"):
    """Runs `python -m serving.cli.main serve ARGS --port P` until /health is 200.

    ``log_level`` is the server's ``--log-level``. Yields (process, base URL, log file); kills the process on exit if it is
    still running. Fails the test with the server's log if it dies or is not
    healthy within timeout_s seconds.
    """
    port = free_port()
    if "--database-url" not in serve_args:  # keep the shared data dir's ledger out of it
        serve_args = [*serve_args, "--database-url", f"sqlite:///{Path(log_path).parent / 'ledger.db'}"]
    log = open(log_path, "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.cli.main", "--log-level", log_level, "serve", *serve_args,
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                pytest.fail(f"server did not become healthy:\n{log.read()[-4000:]}")
            time.sleep(0.5)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
