"""Two processes on loopback, 4 fake CPU devices each, form one 8-device mesh with
``jax.distributed``: same logits as one process, and a greedy completion served
in lockstep equals the one-process engine's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from model.config import ModelConfig
from model.factory import build_model
from serving.engine.engine import Engine, EngineConfig
from serving.loading.model_registry import known_models
from serving.runtime.engine_loop import EngineLoop
from tests.support.engine_helpers import generate, request
from tests.support.paths import REPO_ROOT as ROOT
from tests.support.sharded_forward import assert_close, run_steps

TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(out_dir: Path) -> list[str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.multihost_worker", str(port), str(i), str(out_dir)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for p in procs:  # always: a hung collective must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-6000:]}"
    return outputs


@pytest.mark.slow(50)
def test_two_processes_one_mesh(tmp_path):
    """Two processes join one mesh (jax.distributed on loopback) and compute the one-device
    model's logits.

    Slow: two child processes each start JAX and compile the sharded steps."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    outputs = _run_two_processes(tmp_path)
    cfg = ModelConfig.from_dict(known_models()["tiny-moe"]["config"])
    want = run_steps(build_model(cfg, rngs=nnx.Rngs(0)), rows=2)
    assert_close(np.load(tmp_path / "logits.npy"), want, 1e-4, "tiny-moe on 2 processes x 4 devices")

    cfg = ModelConfig.from_dict(known_models()["tiny-llama"]["config"])
    loop = EngineLoop(Engine(build_model(cfg, rngs=nnx.Rngs(0)),
                             EngineConfig(max_slots=2, num_pages=32, max_model_len=128,
                                          prefill_chunk=16, min_decode_batch=1)))
    loop.start(warmup=False)
    try:
        one = generate(loop, [request(list(range(5, 25)), max_tokens=8, ignore_eos=True)])[0]
    finally:
        loop.stop()
    two = json.loads((tmp_path / "ids.json").read_text())
    assert two == one and len(one) == 8
    assert "process 1 followed" in outputs[1], outputs[1][-2000:]
