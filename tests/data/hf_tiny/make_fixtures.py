"""Builds the tiny Hugging Face checkpoints in this folder and transformers' outputs for them.

Used by tests/model/test_hf_checkpoint.py, which loads the same files through
``model.safetensors_loader`` (no torch at test time) and must reproduce
transformers' float32 logits (within 1e-4) and greedy ids (up to the first
step whose top-1/top-2 margin is below ``cutoff``).

Run once, in a throwaway virtualenv (torch's CPU wheel, as benchmarks/RESULTS.md
installs the baselines), from the repository root::

    python -m venv .venv-fixtures
    .venv-fixtures/bin/pip install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu
    .venv-fixtures/bin/pip install transformers==5.24.0 safetensors
    .venv-fixtures/bin/python tests/data/hf_tiny/make_fixtures.py [CASE ...]

With case names (e.g. ``qwen2 phi3 gemma2``, the cases added later) it writes
only those, leaving the other folders and ``rope.json`` as they are.

For each case (``CASES``) it builds the model class with random weights (seeded;
every weight, norms included, drawn so that a mis-mapped tensor shows in the
logits), saves it with ``save_pretrained`` (float32 safetensors; the "llama"
case in several shards with ``model.safetensors.index.json``), and writes:

  * ``<case>/config.json`` and the safetensors files (as transformers wrote them;
    the ``*_v4cfg`` cases then have their config rewritten in the transformers
    v4 spelling that hub checkpoints use: ``rope_theta`` + ``rope_scaling``
    instead of ``rope_parameters``, no ``layer_types``; the script checks that
    transformers reloads the rewritten directory to the same logits);
  * ``<case>/logits.npy``: float32 [T, vocab], logits at every prompt position
    (one forward pass, eager attention);
  * ``<case>/greedy_logits.npy``: float32 [12, vocab], the logits each greedy
    step chose its token from;
  * ``<case>/golden.json``: the prompt, ``greedy`` (argmax ids of 12 new tokens,
    each step a full forward pass over the sequence so far, and each step's
    top-1 minus top-2 logit), the ``cutoff``, the RoPE inverse frequencies and
    attention factor transformers computed, and the versions used.

For Mixtral and Qwen3-MoE it also checks that transformers' fused expert layout
(``save_original_format=False``) is the per-expert tensors stacked, as
tests/model/test_hf_checkpoint.py builds it (that layout is not committed).

``rope.json`` holds transformers' inverse frequencies and attention factors for
the RoPE scaling types at real models' sizes (Llama 3.1 8B's llama3, Qwen3's
yarn with a factor of 4, Gemma 3 4B's linear 8), for tests/model/test_hf_config.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import safetensors
import torch
import transformers

HERE = Path(__file__).resolve().parent
VOCAB = 256
PROMPT = [1, 17, 200, 3, 42, 9, 28, 111, 60, 5, 33, 7, 250, 64, 19, 2]
NEW_TOKENS = 12
CUTOFF = 2e-4  # 2 x the logits tolerance, the golden data's rule (tests/data/gemma3_270m_golden.json)

BASE = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, intermediate_size=48, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES = {
    # name: (transformers class, config class, config kwargs, save kwargs, rewrite to v4 config)
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        BASE, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)),
        dict(max_shard_size="100KB"), True),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(
        BASE, rope_theta=10000.0, sliding_window=5, tie_word_embeddings=False), {}, True),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        BASE, head_dim=16, num_key_value_heads=4, rope_theta=1e6, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=6, max_window_layers=1,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
        {}, False),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        BASE, head_dim=16, num_key_value_heads=1, rope_theta=1e6, rope_local_base_freq=10000.0,
        query_pre_attn_scalar=24, sliding_window=4, sliding_window_pattern=2,
        final_logit_softcapping=30.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=2.0)), {}, True),
    "gemma3_mm": ("Gemma3ForConditionalGeneration", "Gemma3Config", dict(
        text_config=dict(BASE, head_dim=16, num_key_value_heads=1, rope_theta=1e6,
                         rope_local_base_freq=10000.0, query_pre_attn_scalar=16, sliding_window=4,
                         sliding_window_pattern=2, model_type="gemma3_text"),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14,
                           model_type="siglip_vision_model"),
        mm_tokens_per_image=4, image_token_index=255, boi_token_index=253, eoi_token_index=254),
        {}, False),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        BASE, head_dim=None, num_attention_heads=8, rope_theta=1e6, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=16, sliding_window=None,
        tie_word_embeddings=False), {}, True),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        BASE, head_dim=16, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False), {}, False),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        BASE, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False), {}, True),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(
        BASE, rope_theta=10000.0, partial_rotary_factor=0.5,
        max_position_embeddings=256, original_max_position_embeddings=64, sliding_window=7,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.7, 3.1],
                          long_factor=[1.3, 4.2, 11.5])), {}, True),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        BASE, head_dim=16, num_key_value_heads=1, rope_theta=10000.0, query_pre_attn_scalar=24,
        sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
        tie_word_embeddings=True), {}, True),
}
NEW_CASES = ("qwen2", "phi3", "gemma2")
"""Added after the first seven (issue 30); ``main(NEW_CASES)`` writes only these."""


def randomize(model: torch.nn.Module, seed: int, gemma: bool) -> None:
    """Every weight random: matrices N(0, 1/fan_in) (x 3 for sharp logits), norms around
    their identity (Gemma's 1 + w: w around 0), except Gemma's post-attention / post-MLP
    norms, around 3 x identity: its embeddings enter scaled by sqrt(hidden), and with
    identity post-norms the tied head would only echo the input token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                centre = (2.0 if "post_" in name else 0.0) if gemma else 1.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(3.0 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def forward_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


def greedy(model, prompt: list[int]) -> tuple[list[int], list[float], np.ndarray]:
    ids, new, margins, rows = list(prompt), [], [], []
    for _ in range(NEW_TOKENS):
        rows.append(forward_logits(model, ids)[-1])
        last = rows[-1].astype(np.float64)
        top2 = np.sort(last)[-2:]
        tok = int(np.argmax(last))
        new.append(tok)
        margins.append(float(top2[1] - top2[0]))
        ids.append(tok)
    return new, margins, np.stack(rows)


def rope_tables(model) -> dict:
    """The inverse frequencies / attention factors of the model's rotary embeddings."""
    out = {}
    for name, mod in model.named_modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if "inv_freq" in bname and "original" not in bname:
                out[f"{name}.{bname}"] = buf.float().tolist()
        for attr in dir(mod):
            if attr.endswith("attention_scaling") and not attr.startswith("__"):
                val = getattr(mod, attr)
                if isinstance(val, (int, float)):
                    out[f"{name}.{attr}"] = float(val)
    return out


def to_v4_config(d: dict) -> dict:
    """transformers v5's config.json -> the v4 spelling (rope_theta + rope_scaling, no layer_types)."""
    d = dict(d)
    params = d.pop("rope_parameters", None)
    if params:
        if "full_attention" in params:  # Gemma 3: per layer type
            d["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
            params = params["full_attention"]
        params = dict(params)
        d["rope_theta"] = params.pop("rope_theta")
        if "partial_rotary_factor" in params:  # Phi-3 / Phi-4-mini keep it at the top level
            d["partial_rotary_factor"] = params.pop("partial_rotary_factor")
        if params.get("rope_type") == "longrope":  # Phi-3: the top level's, not repeated
            if params.get("original_max_position_embeddings") == d.get("original_max_position_embeddings"):
                params.pop("original_max_position_embeddings")
        d["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    d.pop("layer_types", None)
    return d


def check_fused_experts(model, out: Path) -> None:
    """transformers v5's own MoE layout (save_original_format=False) is the per-expert tensors
    stacked: gate_up_proj = concat([gate, up], rows), down_proj = stack(down)
    (tests/model/test_hf_checkpoint.py::test_fused_expert_layout_loads_alike builds it so)."""
    import tempfile

    from safetensors.numpy import load_file

    per_expert = load_file(str(out / "model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=False)
        fused = load_file(str(Path(tmp) / "model.safetensors"))
    cfg = model.config
    n = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    moe = "block_sparse_moe" if any("block_sparse_moe" in k for k in per_expert) else "mlp"
    gate, up, down = ("w1", "w3", "w2") if moe == "block_sparse_moe" else (
        "gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."

        def stack(w, p=p):
            return np.stack([per_expert[f"{p}{moe}.experts.{e}.{w}.weight"] for e in range(n)])

        assert np.array_equal(fused[p + "mlp.gate.weight"], per_expert[f"{p}{moe}.gate.weight"])
        assert np.array_equal(fused[p + "mlp.experts.gate_up_proj"],
                              np.concatenate([stack(gate), stack(up)], axis=1))
        assert np.array_equal(fused[p + "mlp.experts.down_proj"], stack(down))


def longrope_tables(model) -> dict:
    """Phi-3: the long-factor inverse frequencies transformers switches to past the original
    context, and the attention factor (``ROPE_INIT_FUNCTIONS["longrope"]``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = model.config
    original = cfg.original_max_position_embeddings
    inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=original + 1)
    return {"long_inv_freq": inv_freq.float().tolist(), "attention_factor": float(attention),
            "original_max_position_embeddings": original}


def make_case(name: str, seed: int) -> None:
    cls_name, cfg_name, cfg_kw, save_kw, v4 = CASES[name]
    cfg = getattr(transformers, cfg_name)(**cfg_kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).eval()
    randomize(model, seed, gemma=cls_name.startswith("Gemma"))
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True, **save_kw)
    if v4:
        path = out / "config.json"
        path.write_text(json.dumps(to_v4_config(json.loads(path.read_text())), indent=2) + "\n")
    logits = forward_logits(model, PROMPT)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager") if cls_name != \
        "Gemma3ForConditionalGeneration" else getattr(transformers, cls_name).from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager")
    again = forward_logits(reloaded.eval(), PROMPT)
    assert np.array_equal(logits, again), f"{name}: the saved directory reloads to other logits"
    if name in ("mixtral", "qwen3_moe"):
        check_fused_experts(model, out)
    ids, margins, step_logits = greedy(model, PROMPT)
    np.save(out / "logits.npy", logits.astype(np.float32))
    np.save(out / "greedy_logits.npy", step_logits.astype(np.float32))
    (out / "golden.json").write_text(json.dumps({
        "architecture": cls_name,
        "prompt": PROMPT,
        "greedy": {"ids": ids, "step_top1_top2_margin": margins},
        "cutoff": CUTOFF,
        "rope": rope_tables(model),
        **({"longrope": longrope_tables(model)} if name == "phi3" else {}),
        "logits_abs_max": float(np.abs(logits).max()),
        "source": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                  f"safetensors {safetensors.__version__}; tests/data/hf_tiny/make_fixtures.py",
    }, indent=1) + "\n")
    print(f"{name}: |logits| max {np.abs(logits).max():.2f}, margins min "
          f"{min(margins):.4f}, greedy {ids}")


def make_rope_json() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = {
        "llama31_8b_llama3": ("LlamaConfig", dict(
            hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8192))),
        "qwen3_yarn_4": ("Qwen3Config", dict(
            hidden_size=4096, num_attention_heads=32, head_dim=128, rope_theta=1e6,
            max_position_embeddings=131072,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))),
        "yarn_mscale": ("LlamaConfig", dict(
            hidden_size=2048, num_attention_heads=16, head_dim=128, rope_theta=10000.0,
            max_position_embeddings=163840,
            rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                              beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707))),
        "gemma3_4b_linear_8": ("LlamaConfig", dict(
            hidden_size=2560, num_attention_heads=8, head_dim=256, rope_theta=1e6,
            max_position_embeddings=131072, rope_scaling=dict(rope_type="linear", factor=8.0))),
    }
    out = {}
    for name, (cfg_name, kw) in cases.items():
        cfg = getattr(transformers, cfg_name)(**kw)
        kind = kw["rope_scaling"]["rope_type"]
        inv_freq, attention = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        config_json = json.loads(cfg.to_json_string())
        out[name] = {"config": {k: config_json[k] for k in config_json
                                if k.startswith("rope") or k in kw or k == "architectures"},
                     "inv_freq": inv_freq.float().tolist(), "attention_factor": float(attention)}
    (HERE / "rope.json").write_text(json.dumps({
        "source": f"transformers {transformers.__version__} modeling_rope_utils.ROPE_INIT_FUNCTIONS, "
                  f"torch {torch.__version__}; tests/data/hf_tiny/make_fixtures.py",
        "cases": out}, indent=1) + "\n")


def main(names: list[str]) -> None:
    """Writes the cases named (all, and rope.json, when none is)."""
    torch.set_num_threads(2)
    for seed, name in enumerate(CASES):
        if not names or name in names:
            make_case(name, seed)
    if not names:
        make_rope_json()


if __name__ == "__main__":
    import sys

    unknown = set(sys.argv[1:]) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    main(sys.argv[1:])
