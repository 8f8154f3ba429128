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


BIND_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(serve_args: list[str], log_path: Path, timeout_s: float = 240, log_level: str = "WARNING"):
    """Runs `python -m serving.cli.main serve ARGS --port P` until /health is 200.

    ``log_level`` is the server's ``--log-level``. Yields (process, base URL, log file); kills the process on exit if it is
    still running. A server that dies because its port was taken meanwhile is started again
    on another (``BIND_ATTEMPTS`` in all). Fails the test with the server's log if it dies or is
    not healthy within timeout_s seconds.
    """
    if "--database-url" not in serve_args:  # keep the shared data dir's ledger out of it
        serve_args = [*serve_args, "--database-url", f"sqlite:///{Path(log_path).parent / 'ledger.db'}"]
    log = open(log_path, "w+")
    proc = None
    try:
        # A free port can be taken by another worker's process between free_port() and the
        # server's bind (seen once in a fresh-clone run): a server that dies of that starts again
        # on another port.
        for attempt in range(BIND_ATTEMPTS):
            port = free_port()
            log.seek(0)
            log.truncate()
            proc = subprocess.Popen(
                [sys.executable, "-m", "serving.cli.main", "--log-level", log_level, "serve", *serve_args,
                 "--port", str(port)],
                stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + timeout_s
            while True:
                try:
                    # (healthy and ours: another process may hold the port our server could not bind)
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200 and proc.poll() is None:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    text = log.read()
                    if proc.poll() is not None and "address already in use" in text and attempt + 1 < BIND_ATTEMPTS:
                        break
                    pytest.fail(f"server did not become healthy:\n{text[-4000:]}")
                time.sleep(0.5)
            if proc.poll() is None:
                break
        yield proc, url, log
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
