"""SIGTERM drains: the listener closes, open streams finish, then the process exits."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.support.server_process import TINY_SERVER_ARGS, serve_process


@pytest.fixture
def tiny_server(tmp_path):
    with serve_process(TINY_SERVER_ARGS + ["--drain-timeout", "60", "--skip-warmup"], tmp_path / "server.log") as running:
        yield running


def test_sigterm_lets_open_streams_finish(tiny_server):
    proc, url, log = tiny_server
    body = {"model": "tiny-random", "prompt": "drain me", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(f"{url}/health", timeout=2)
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 480
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # uvicorn re-raises the captured SIGTERM once it has shut down cleanly.
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    log.seek(0)
    assert "Traceback" not in log.read()
