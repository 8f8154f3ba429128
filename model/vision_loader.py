"""Gemma 3's vision tower from a Hugging Face checkpoint: ``config.json`` + safetensors ->
:class:`model.gemma3_vision.Gemma3VisionTower`.

Tensor names (transformers' ``Gemma3ForConditionalGeneration``; the tower's prefix is
``vision_tower.vision_model.`` in the released checkpoints, ``vision_tower.`` as transformers
v5 saves it, either under ``model.``; the projector's ``multi_modal_projector.``)::

    embeddings.patch_embedding.weight [E, C, p, p], .bias [E]    -> patch_embed [C*p*p, E], patch_bias
    embeddings.position_embedding.weight [P, E]                  -> pos_embed
    encoder.layers.{i}.layer_norm{1,2}.weight / .bias [E]        -> ln{1,2}_scale / _bias [L, E]
    encoder.layers.{i}.self_attn.{q,k,v,out}_proj.weight [E, E]  -> wq, wk, wv, wo [L, E, E] (transposed)
    encoder.layers.{i}.mlp.fc1.weight [F, E], fc2 [E, F]         -> fc1 [L, E, F], fc2 [L, F, E]
    post_layernorm.weight / .bias                                -> post_ln_scale / _bias
    multi_modal_projector.mm_input_projection_weight [E, D]      -> mm_input_projection
    multi_modal_projector.mm_soft_emb_norm.weight [E]            -> mm_soft_emb_norm (1 + w)

SigLIP's attention-pooling ``head.*`` is not used by Gemma 3 and is not read. The tower is
small (about 400M parameters in the released models) and is read whole, in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from model.gemma3_vision import Gemma3VisionConfig, Gemma3VisionTower, read_vision_config

__all__ = ["load_vision_tower"]

_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
                   "model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors nor model.safetensors.index.json")
    with safe_open(single, "np") as f:
        return {name: single for name in f.keys()}


def load_vision_tower(model_dir: str | Path) -> Gemma3VisionTower | None:
    """The vision tower of the checkpoint in ``model_dir`` (None: its config has no
    ``vision_config``, a text-only model).

    Raises:
      ValueError: a tensor missing (named) or misshapen; a config field missing.
      FileNotFoundError: no safetensors file.
    """
    model_dir = Path(model_dir)
    cfg = read_vision_config(json.loads((model_dir / "config.json").read_text()))
    if cfg is None:
        return None
    files = _tensor_files(model_dir)
    tower = next((p for p in _TOWER_PREFIXES if p + "post_layernorm.weight" in files), None)
    proj = next((p for p in _PROJECTOR_PREFIXES if p + "mm_input_projection_weight" in files), None)
    if tower is None or proj is None:
        raise ValueError(f"{model_dir.name}: the config has a vision_config but the checkpoint lacks "
                         "'vision_tower.[vision_model.]post_layernorm.weight' or "
                         "'multi_modal_projector.mm_input_projection_weight'")

    def read(name: str) -> np.ndarray:
        if name not in files:
            raise ValueError(f"{model_dir.name}: the checkpoint lacks tensor {name!r}")
        with safe_open(files[name], "np") as f:
            return np.asarray(f.get_tensor(name), np.float32)

    return Gemma3VisionTower(cfg, _params(cfg, tower, proj, read))


def _params(cfg: Gemma3VisionConfig, tower: str, proj: str, read) -> dict:
    s = cfg.siglip
    E = s.hidden_size
    patch = read(tower + "embeddings.patch_embedding.weight")  # [E, C, p, p]
    siglip = {
        "patch_embed": patch.reshape(E, -1).T,
        "patch_bias": read(tower + "embeddings.patch_embedding.bias"),
        "pos_embed": read(tower + "embeddings.position_embedding.weight"),
        "post_ln_scale": read(tower + "post_layernorm.weight"),
        "post_ln_bias": read(tower + "post_layernorm.bias"),
    }
    per_layer = {  # ours: (theirs, transposed)
        "ln1_scale": ("layer_norm1.weight", False), "ln1_bias": ("layer_norm1.bias", False),
        "ln2_scale": ("layer_norm2.weight", False), "ln2_bias": ("layer_norm2.bias", False),
        "wq": ("self_attn.q_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
        "wk": ("self_attn.k_proj.weight", True), "bk": ("self_attn.k_proj.bias", False),
        "wv": ("self_attn.v_proj.weight", True), "bv": ("self_attn.v_proj.bias", False),
        "wo": ("self_attn.out_proj.weight", True), "bo": ("self_attn.out_proj.bias", False),
        "fc1": ("mlp.fc1.weight", True), "fc1_bias": ("mlp.fc1.bias", False),
        "fc2": ("mlp.fc2.weight", True), "fc2_bias": ("mlp.fc2.bias", False),
    }
    for ours, (theirs, transpose) in per_layer.items():
        layers = [read(f"{tower}encoder.layers.{i}.{theirs}") for i in range(s.num_layers)]
        siglip[ours] = np.stack([w.T if transpose else w for w in layers])
    return {
        "siglip": siglip,
        "mm_soft_emb_norm": 1.0 + read(proj + "mm_soft_emb_norm.weight"),
        "mm_input_projection": read(proj + "mm_input_projection_weight"),
    }
