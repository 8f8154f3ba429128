"""The adapter registry's tiers (``serving.engine.lora_registry``) over a fake engine: device
slots least recently used first, pinned slots never taken, the host LRU read again from disk,
and removal refused while in use."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from model.hf_config import read_hf_config
from model.lora_adapter import LoraAdapterError
from serving.config.engine_config import EngineConfig
from serving.engine.lora_registry import LoraInUseError, LoraRegistry
from tests.support.paths import TEST_DATA

LORA = TEST_DATA / "lora_tiny"


@dataclasses.dataclass
class FakeEngine:
    cfg: EngineConfig
    model_cfg: object
    writes: list = dataclasses.field(default_factory=list)

    def write_lora_slot(self, slot, adapter):
        self.writes.append((slot, adapter.digest))


def _registry(max_loras=2, max_cpu_loras=None):
    engine = FakeEngine(EngineConfig(max_loras=max_loras, max_lora_rank=8),
                        read_hf_config(TEST_DATA / "hf_tiny" / "llama"))
    reg = LoraRegistry(engine, max_cpu_loras)
    for name in ("r4", "r8", "rs8"):
        reg.add(name, LORA / f"llama_{name}")
    return reg, engine


def test_slots_are_reused_least_recently_used_first_and_pins_hold():
    reg, engine = _registry()
    a = reg.acquire("r4")
    b = reg.acquire("r8")
    assert {a.slot, b.slot} == {1, 2} and reg.acquire("rs8") is None  # both pinned
    again = reg.acquire("r4")  # resident: no write
    assert again.slot == a.slot and len(engine.writes) == 2
    reg.release(b)
    c = reg.acquire("rs8")  # r8's slot is the only unpinned one
    assert c.slot == b.slot and engine.writes[-1] == (b.slot, reg.digest("rs8"))
    for g in (a, again, c):
        reg.release(g)
    assert reg.acquire("r8").slot == a.slot  # r4 was used before rs8: its slot goes
    with pytest.raises(RuntimeError, match="released more often"):
        reg.release(b)


def test_remove_refused_in_use_and_frees_the_slot():
    reg, engine = _registry()
    g = reg.acquire("r4")
    with pytest.raises(LoraInUseError, match="in use by 1"):
        reg.remove("r4")
    reg.release(g)
    reg.remove("r4")
    assert "r4" not in reg.names() and reg.in_use("r4") == 0
    with pytest.raises(KeyError):
        reg.acquire("r4")
    with pytest.raises(KeyError):
        reg.remove("r4")
    assert reg.acquire("r8").slot == g.slot  # the freed slot is taken first


def test_host_lru_reads_again_and_checks_the_digest(tmp_path):
    reg, engine = _registry(max_loras=1, max_cpu_loras=1)
    path = tmp_path / "x"
    shutil.copytree(LORA / "llama_r8", path)
    reg.add("x", path)
    assert list(reg._host) == ["x"]  # one kept in host memory
    g = reg.acquire("r4")  # read again from its folder
    assert engine.writes[-1] == (1, reg.digest("r4"))
    reg.release(g)
    (path / "adapter_config.json").write_text((path / "adapter_config.json").read_text().replace(
        '"lora_alpha": 16', '"lora_alpha": 3'))
    with pytest.raises(LoraAdapterError, match="changed since it was loaded"):
        reg.acquire("x")  # not in host memory any more, and its folder now reads otherwise


def test_refusals():
    model_cfg = read_hf_config(TEST_DATA / "hf_tiny" / "llama")
    with pytest.raises(ValueError, match="--max-loras 0"):
        LoraRegistry(FakeEngine(EngineConfig(), model_cfg)).add("x", LORA / "llama_r4")
    reg, _ = _registry()
    with pytest.raises(ValueError, match="already loaded"):
        reg.add("r4", LORA / "llama_r4")
    small = LoraRegistry(FakeEngine(EngineConfig(max_loras=1, max_lora_rank=4), model_cfg))
    with pytest.raises(LoraAdapterError, match="--max-lora-rank 4"):
        small.add("r8", LORA / "llama_r8")
    assert small.names() == ()


def test_backend_policy_picks_the_lora_formulation():
    from serving.engine.backend_policy import BackendPolicy

    policy = BackendPolicy.for_platform("cpu")
    assert policy.lora_formulation(5, 16) == "onehot"  # 80 columns: two dense dots over all slots
    assert policy.lora_formulation(33, 16) == "gather"  # 528 columns: each row's own slot
