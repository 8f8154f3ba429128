"""PEFT LoRA adapters through ``model.lora_adapter`` / ``model.lora`` against PEFT's own outputs.

tests/data/lora_tiny (made once by its make_fixtures.py with peft, ``init_lora_weights=False``)
holds three adapters for each of the Llama, Mistral, Qwen3 and Gemma 3 checkpoints of
tests/data/hf_tiny: rank 4 on all seven projections, rank 8 on q/k/v/o, rank 8 rsLoRA on q and
the MLP, with ``PeftModel``'s float32 logits and greedy ids. All three are resident at once in
one stack (slots 1..3, rank 4 zero-padded to 8), each picked by its slot; no torch here.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from model.compute import Compute
from model.factory import build_model
from model.lora import slot_weights, write_slot, zero_stacks
from model.lora_adapter import read_peft_adapter
from model.safetensors_loader import load_hf_checkpoint
from tests.support.hf_tiny_parity import ATOL, DATA, agree_until_near_tie, prefill_then_greedy
from tests.support.paths import TEST_DATA

LORA = TEST_DATA / "lora_tiny"
KINDS = ("r4", "r8", "rs8")
MAX_RANK = 8


def resident_stacks(cfg, adapters):
    stacks = zero_stacks(cfg, len(adapters), MAX_RANK)
    for slot, adapter in enumerate(adapters, start=1):
        stacks = write_slot(stacks, slot, slot_weights(adapter, cfg, MAX_RANK))
    return stacks


@pytest.mark.parametrize("case,formulation", [("llama", "onehot"), ("mistral", "onehot"),
                                              ("qwen3", "onehot"), ("gemma3_text", "onehot"),
                                              ("llama", "gather")])
def test_logits_and_greedy_ids_match_peft(case, formulation):
    cfg, params = load_hf_checkpoint(DATA / case, dtype="float32", progress=False)
    model = build_model(cfg, params=params, dtype=jnp.float32)
    adapters = [read_peft_adapter(LORA / f"{case}_{kind}", cfg, max_rank=MAX_RANK) for kind in KINDS]
    assert [a.rank for a in adapters] == [4, 8, 8] and adapters[2].use_rslora
    assert adapters[2].scaling == pytest.approx(4 / np.sqrt(8))
    stacks = resident_stacks(cfg, adapters)
    compute = Compute(lora=formulation)
    for slot, kind in enumerate(KINDS, start=1):
        ref = json.loads((LORA / f"{case}_{kind}" / "golden.json").read_text())
        logits, ids, _ = prefill_then_greedy(model, ref["prompt"], len(ref["greedy"]["ids"]), compute,
                                             lora=(stacks, slot))
        want = np.load(LORA / f"{case}_{kind}" / "logits.npy")
        err = np.abs(logits - want).max()
        assert err <= ATOL, f"{case}_{kind}: logits differ from PEFT's by {err:.2e}"
        assert ref["adapter_change_abs_max"] > 1.0  # the adapter matters: a wrong slot would show
        assert agree_until_near_tie(ids, ref, f"{case}_{kind}") >= 6
    # slot 0 is the base model: transformers' logits without any adapter
    base, _, _ = prefill_then_greedy(model, ref["prompt"], 1, compute, lora=(stacks, 0))
    assert np.abs(base - np.load(DATA / case / "logits.npy")).max() <= ATOL
