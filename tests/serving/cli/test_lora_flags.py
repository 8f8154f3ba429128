"""The LoRA flags (``--lora-modules NAME=PATH ...``, ``--max-loras``, ``--max-lora-rank``,
``--max-cpu-loras``) through the shared settings into ``ServerConfig`` and ``EngineConfig``."""

from __future__ import annotations

import argparse

import pytest

from serving.cli.settings import _add_settings, _overrides
from serving.config.engine_config import EngineConfig
from serving.config.server_config import ServerConfig
from tests.support.paths import TEST_DATA


def _config(argv):
    p = argparse.ArgumentParser()
    _add_settings(p)
    return ServerConfig().with_overrides(_overrides(p.parse_args(argv)))


def test_lora_flags_reach_the_engine_config():
    cfg = _config(["--lora-modules", "a=/x/a", "b = /x/b", "--max-lora-rank", "8", "--max-cpu-loras", "3"])
    assert cfg.lora_modules == (("a", "/x/a"), ("b", "/x/b"))
    assert cfg.lora_slots == 2 and cfg.max_cpu_loras == 3  # max_loras: as many as named, at most 4
    eng = EngineConfig.from_server_config(cfg, _ModelCfg())
    assert (eng.max_loras, eng.max_lora_rank) == (2, 8)
    assert _config([]).lora_slots == 0 and EngineConfig.from_server_config(_config([]), _ModelCfg()).max_loras == 0
    assert _config(["--max-loras", "3"]).lora_slots == 3  # adapters loaded at run time only
    assert ServerConfig(lora_modules={"m": str(TEST_DATA)}).lora_modules == (("m", str(TEST_DATA)),)


@pytest.mark.parametrize("kwargs,message", [
    (dict(lora_modules=["nopath"]), "NAME=PATH"),
    (dict(lora_modules=["a=/x", "a=/y"]), "twice"),
    (dict(lora_modules=["a=/x"], max_loras=0), "max_loras >= 1"),
    (dict(max_lora_rank=0), "max_lora_rank"),
])
def test_bad_lora_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kwargs)


class _ModelCfg:
    max_position = 4096
