"""Builds tests/data/hf_tiny/gemma3_vision/: a tiny ``Gemma3ForConditionalGeneration`` with a
SigLIP tower that its tests run, two test images, and transformers' outputs for a prompt holding
both images.

Used by tests/model/test_gemma3_vision.py (no torch at test time): the image features within
1e-4 of ``get_image_features``, our preprocessing equal to the processor's pixels, the logits at
every prompt position within 1e-4 and the greedy ids equal (up to the near-tie cutoff).

Run once, in a throwaway virtualenv, from the repository root (as make_fixtures.py)::

    python -m venv .venv-fixtures
    .venv-fixtures/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors pillow numpy
    .venv-fixtures/bin/python tests/data/hf_tiny/make_vision_fixtures.py

What it writes in ``gemma3_vision/``:

  * ``config.json``, ``model.safetensors``: as ``save_pretrained`` wrote them; text model as
    make_fixtures.py's ``gemma3_mm`` (vocabulary 256, hidden 48, 2 layers, sliding window 4 on
    layer 0); SigLIP hidden 32, 2 layers, 2 heads, image 56 px in 7 px patches (an 8 x 8
    grid) pooled 2 x 2 to ``mm_tokens_per_image`` 16 soft tokens (longer than the sliding
    window, so a sliding layer's window cuts into an image); ids: image 255, boi 253, eoi 254.
    Every weight random (seeded), as make_fixtures.py's ``randomize``.
  * ``image_a.png`` (70 x 40, RGB) and ``image_b.png`` (90 x 90, grey + alpha: converted to
    RGB): deterministic numpy patterns.
  * ``pixel_values.npy``: float32 [2, 3, 56, 56], ``Gemma3ImageProcessorPil``'s output
    (PIL bilinear resize, x / 255, (x - 0.5) / 0.5). transformers' default
    ``Gemma3ImageProcessor`` resizes with torchvision instead (not installed here); ours
    follows the PIL processor, with Pillow.
  * ``image_features.npy``: float32 [2, 16, 48], ``get_image_features(...).pooler_output``.
  * ``logits.npy``: float32 [T, 256], logits at every prompt position (eager attention,
    ``token_type_ids`` given, so the image tokens attend bidirectionally within each image);
    ``greedy_logits.npy`` [12, 256]: the logits each greedy step chose from.
  * ``golden.json``: the prompt ids, the token type ids, the greedy ids and margins, the
    cutoff and versions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import PIL
import safetensors
import torch
import transformers
from PIL import Image

HERE = Path(__file__).resolve().parent
OUT = HERE / "gemma3_vision"
IMAGE, BOI, EOI = 255, 253, 254
MM_TOKENS = 16
NEW_TOKENS = 12
CUTOFF = 2e-4


def image_span() -> list[int]:
    return [BOI] + [IMAGE] * MM_TOKENS + [EOI]


PROMPT = [1, 17, 200] + image_span() + [3, 42, 9] + image_span() + [28, 111, 60, 5]

TEXT = dict(vocab_size=256, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, intermediate_size=48, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, query_pre_attn_scalar=16,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"])
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=56, patch_size=7, model_type="siglip_vision_model")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """As make_fixtures.py: matrices N(0, 3^2 / fan_in), Gemma norms (1 + w) with w around 0
    (post-norms around 2), LayerNorm scales around 1, biases around 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                if "vision_tower" in name:
                    centre = 1.0 if name.endswith("layer_norm1.weight") or name.endswith(
                        "layer_norm2.weight") or name.endswith("layernorm.weight") else 0.0
                else:
                    centre = 2.0 if "post_" in name else 0.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.ndim == 2 else p[0].numel()
                if name.endswith("mm_input_projection_weight"):
                    fan_in = p.shape[0]
                p.copy_(3.0 * torch.randn(p.shape, generator=g) / fan_in ** 0.5)


def test_images() -> list[Image.Image]:
    y, x = np.mgrid[0:40, 0:70]
    a = np.stack([(x * 255 // 69), (y * 255 // 39), ((x * y) % 256)], axis=-1).astype(np.uint8)
    y, x = np.mgrid[0:90, 0:90]
    grey = (((x // 9 + y // 9) % 2) * 200 + (x + y) % 50).astype(np.uint8)
    alpha = np.full_like(grey, 255)
    return [Image.fromarray(a, "RGB"), Image.fromarray(np.stack([grey, alpha], -1), "LA")]


def forward_logits(model, ids: list[int], pixel_values: torch.Tensor) -> np.ndarray:
    tt = torch.tensor([[1 if t == IMAGE else 0 for t in ids]])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values, token_type_ids=tt,
                    use_cache=False)
    return out.logits[0].float().numpy()


def main() -> None:
    torch.set_num_threads(2)
    cfg = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=MM_TOKENS,
                                    image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(7)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    randomize(model, 7)
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_pretrained(OUT, safe_serialization=True)
    images = test_images()
    for name, im in zip(("image_a.png", "image_b.png"), images):
        im.save(OUT / name)
    images = [Image.open(OUT / n) for n in ("image_a.png", "image_b.png")]  # as decoded from the files
    proc = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    pixel_values = proc(images, return_tensors="pt")["pixel_values"].float()
    assert pixel_values.shape == (2, 3, 56, 56), pixel_values.shape
    with torch.no_grad():
        feats = model.get_image_features(pixel_values).pooler_output.float().numpy()
    assert feats.shape == (2, MM_TOKENS, 48), feats.shape
    logits = forward_logits(model, PROMPT, pixel_values)
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        OUT, dtype=torch.float32, attn_implementation="eager").eval()
    assert np.array_equal(logits, forward_logits(reloaded, PROMPT, pixel_values))
    ids, new, margins, rows = list(PROMPT), [], [], []
    for _ in range(NEW_TOKENS):
        rows.append(forward_logits(model, ids, pixel_values)[-1])
        last = rows[-1].astype(np.float64)
        top2 = np.sort(last)[-2:]
        new.append(int(np.argmax(last)))
        margins.append(float(top2[1] - top2[0]))
        ids.append(new[-1])
    np.save(OUT / "pixel_values.npy", pixel_values.numpy().astype(np.float32))
    np.save(OUT / "image_features.npy", feats.astype(np.float32))
    np.save(OUT / "logits.npy", logits.astype(np.float32))
    np.save(OUT / "greedy_logits.npy", np.stack(rows).astype(np.float32))
    (OUT / "golden.json").write_text(json.dumps({
        "architecture": "Gemma3ForConditionalGeneration",
        "prompt": PROMPT,
        "images": ["image_a.png", "image_b.png"],
        "token_type_ids": [1 if t == IMAGE else 0 for t in PROMPT],
        "greedy": {"ids": new, "step_top1_top2_margin": margins},
        "cutoff": CUTOFF,
        "logits_abs_max": float(np.abs(logits).max()),
        "source": f"transformers {transformers.__version__} (Gemma3ImageProcessorPil), torch "
                  f"{torch.__version__}, safetensors {safetensors.__version__}, Pillow {PIL.__version__}; "
                  "tests/data/hf_tiny/make_vision_fixtures.py",
    }, indent=1) + "\n")
    print(f"|logits| max {np.abs(logits).max():.2f}, |features| max {np.abs(feats).max():.2f}, "
          f"margins min {min(margins):.4f}, greedy {new}")


if __name__ == "__main__":
    main()
