"""Multi-device tests: run in their own process with 8 fake CPU devices.

``tests/sharding/test_sharding_multidevice.py`` starts ``python -m pytest tests/sharding/multidevice``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the main suite
(one device) does not collect this folder (see ``tests/conftest.py``).
"""

from __future__ import annotations

import os

import jax
import pytest

from tests.support.paths import REPO_ROOT

os.environ.setdefault(
    "XLASERVE_DATA_DIR", str(REPO_ROOT / ".xlaserve-test-data"))
jax.config.update("jax_default_matmul_precision", "highest")

from serving.engine.compilation_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache()


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    n = len(jax.devices())
    assert n == 8, (f"tests/sharding/multidevice needs 8 devices, found {n}: run it through "
                    "tests/sharding/test_sharding_multidevice.py or with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
