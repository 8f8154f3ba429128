"""``xlaserve engine`` replicas as real processes on loopback, and what the tests read of a gateway
over them."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from serving.rpc import engine_pb2 as pb
from serving.rpc import engine_pb2_grpc as pb_grpc
from serving.rpc.channel_security import PLAIN, ClientSecurity, open_channel
from serving.rpc.remote_engine import CHANNEL_OPTIONS
from tests.support.server_process import free_port

# TINY_SERVER_ARGS' pool and slots (their compiled programs are reused: only decode widths past
# 512 tokens are new), a context for a 1024-token prefix and a long stream. No warmup: a replica
# compiles (or loads from the compilation cache) only the shapes its test reaches.
ENGINE_ARGS = ["--model", "tiny-random", "--max-model-len", "2048", "--max-slots", "4", "--num-pages", "256",
               "--min-decode-batch", "4", "--skip-warmup"]


STARTUP_TIMEOUT_S = 240


def start_engine(log_path: Path, args: list[str] = ENGINE_ARGS, scheme: str = "grpc") -> tuple[subprocess.Popen, str]:
    """An ``xlaserve engine`` process (``wait_healthy`` waits for it to answer ready); ``scheme``
    grpcs for one whose ``args`` give it TLS."""
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli.main", "--log-level", "WARNING", "engine",
                             *args, "--grpc-port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    return proc, f"{scheme}://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, security: ClientSecurity = PLAIN,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Waits until the replica answers ``Health`` ready (called with ``security``: TLS material, token)."""
    deadline = time.monotonic() + timeout_s
    # The client's own reconnect backoff (at most 2 s), not gRPC's default (up to 120 s).
    with open_channel(url, security, CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.EngineServiceStub(ch)
        while True:
            try:
                if stub.Health(pb.HealthRequest(), timeout=2).ready:
                    return
            except grpc.RpcError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"engine replica not healthy:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.3)


def trace(gateway: str, response_id: str, headers: dict[str, str] | None = None) -> dict:
    r = httpx.get(f"{gateway}/v1/requests/{response_id}", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def metric(gateway: str, name: str) -> dict[tuple, float]:
    """{label tuple: value} of one metric family on the gateway's /metrics."""
    out = {}
    for line in httpx.get(f"{gateway}/metrics", timeout=10).text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m:
            out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))] = float(m.group(2))
    return out


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    """Polls ``condition()`` until true; fails naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
