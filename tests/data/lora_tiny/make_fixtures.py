"""Builds the tiny PEFT LoRA adapters in this folder and PEFT's float32 outputs for them.

Used by tests/model/test_lora_parity.py (and the engine's LoRA tests), which read
the same files through ``model.lora`` (no torch at test time) over the base
checkpoints of tests/data/hf_tiny and must reproduce ``PeftModel``'s float32
logits within 1e-4.

Run once, in a throwaway virtualenv with torch's CPU wheel, from the repository root::

    python -m venv .venv-fixtures
    .venv-fixtures/bin/pip install torch==2.13.0 transformers==5.24.0 peft==0.21.2 safetensors
    .venv-fixtures/bin/python tests/data/lora_tiny/make_fixtures.py

For each base case of tests/data/hf_tiny (``BASES``) and each adapter kind
(``ADAPTERS``: rank 4 on all seven projections, rank 8 on the attention ones,
rank 8 rsLoRA on q and the MLP) it wraps the base model with ``get_peft_model``
(``init_lora_weights=False``: A and B both random, so the adapter changes the
logits), saves the adapter with ``save_pretrained`` (``adapter_config.json`` +
``adapter_model.safetensors``), reloads it with ``PeftModel.from_pretrained`` and
writes into ``<base>_<kind>/`` (``base_model_name_or_path`` rewritten to the base's
path relative to the repository root):

  * ``logits.npy``: float32 [16, 256], the reloaded ``PeftModel``'s logits at every
    position of hf_tiny's 16-token prompt (eager attention);
  * ``golden.json``: 12 greedy ids (each step a full forward pass), each step's
    top-1 minus top-2 logit, the near-tie ``cutoff``, the largest change the
    adapter makes to the base logits, and the versions used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import peft
import safetensors
import torch
import transformers

HERE = Path(__file__).resolve().parent
HF_TINY = HERE.parent / "hf_tiny"
PROMPT = [1, 17, 200, 3, 42, 9, 28, 111, 60, 5, 33, 7, 250, 64, 19, 2]  # hf_tiny's prompt
NEW_TOKENS = 12
CUTOFF = 2e-4

BASES = ("llama", "mistral", "qwen3", "gemma3_text")
ADAPTERS = {
    # kind: LoraConfig kwargs
    "r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"]),
    "r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "rs8": dict(r=8, lora_alpha=4, use_rslora=True,
                target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
}


def forward_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


def greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, new, margins = list(prompt), [], []
    for _ in range(NEW_TOKENS):
        last = forward_logits(model, ids)[-1].astype(np.float64)
        top2 = np.sort(last)[-2:]
        tok = int(np.argmax(last))
        new.append(tok)
        margins.append(float(top2[1] - top2[0]))
        ids.append(tok)
    return new, margins


def base_model(case: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        HF_TINY / case, dtype=torch.float32, attn_implementation="eager").eval()


def make(case: str, kind: str, seed: int) -> None:
    torch.manual_seed(seed)
    base = base_model(case)
    base_logits = forward_logits(base, PROMPT)
    cfg = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0,
                          **ADAPTERS[kind])
    model = peft.get_peft_model(base, cfg).eval()
    out = HERE / f"{case}_{kind}"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    conf_path = out / "adapter_config.json"  # no machine path: name the base as the tests find it
    conf = json.loads(conf_path.read_text())
    conf["base_model_name_or_path"] = f"tests/data/hf_tiny/{case}"
    conf_path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    reloaded = peft.PeftModel.from_pretrained(base_model(case), out).eval()
    logits = forward_logits(reloaded, PROMPT)
    assert np.array_equal(logits, forward_logits(model, PROMPT)), "the saved adapter reloads to other logits"
    change = float(np.abs(logits - base_logits).max())
    assert change > 0.1, f"{case}_{kind}: the adapter hardly changes the logits ({change})"
    ids, margins = greedy(reloaded, PROMPT)
    np.save(out / "logits.npy", logits.astype(np.float32))
    (out / "golden.json").write_text(json.dumps({
        "base": case,
        "prompt": PROMPT,
        "greedy": {"ids": ids, "step_top1_top2_margin": margins},
        "cutoff": CUTOFF,
        "adapter_change_abs_max": change,
        "source": f"peft {peft.__version__}, transformers {transformers.__version__}, "
                  f"torch {torch.__version__}, safetensors {safetensors.__version__}; "
                  f"tests/data/lora_tiny/make_fixtures.py",
    }, indent=1) + "\n")
    print(f"{case}_{kind}: change {change:.3f}, margins min {min(margins):.4f}, greedy {ids}")


def main() -> None:
    torch.set_num_threads(2)
    seed = 100
    for case in BASES:
        for kind in ADAPTERS:
            make(case, kind, seed)
            seed += 1


if __name__ == "__main__":
    main()
