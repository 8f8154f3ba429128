"""Runs tests/sharding/multidevice in a child process with 8 fake CPU devices.

JAX fixes the device count when it starts, and the rest of the suite runs on
one device, so the multi-device tests (sharded logits for tiny dense and MoE
models and Gemma 3 270M, a served completion on a 1x4x1 mesh, checkpoint
restore across meshes, shard-plan bytes) run as ``python -m pytest
tests/sharding/multidevice`` under ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
A failure shows the child's report.

Multi-device CPU collectives: every test there synchronises each step
(``block_until_ready``) before dispatching the next, see RESULTS.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO_ROOT as ROOT

TIMEOUT_S = 600


@pytest.mark.slow(175)
def test_sharding_suite_on_8_cpu_devices():
    """tests/sharding/multidevice passes in a child process with 8 fake CPU devices.

    Slow: the child starts JAX anew and compiles every sharded program its ~30 tests run (tiny
    dense, MoE and LoRA models and Gemma 3 270M on 1x2x1 to 1x4x1 meshes, a served completion,
    checkpoint restores): ~175 s on a cold cache, one process (its 8 devices are its parallelism)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["XLASERVE_SHARDING_TESTS"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("PYTEST_ADDOPTS", None)  # one process: the 8 fake devices are its parallelism
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/sharding/multidevice"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    report = proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"tests/sharding/multidevice failed (exit {proc.returncode}):\n{report}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, report
