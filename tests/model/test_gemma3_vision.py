"""Gemma 3's vision input against transformers (tests/data/hf_tiny/gemma3_vision, recorded by
make_vision_fixtures.py; no torch here): our preprocessing of the two test images equals
``Gemma3ImageProcessorPil``'s pixels, the SigLIP tower + projector give
``get_image_features`` within 1e-4, and the decoder over a prompt holding both images (soft
tokens spliced at the placeholders, bidirectional attention within each image) gives the
logits at every position within 1e-4 and the greedy ids."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from model.gemma3_vision import encode_images, read_vision_config
from model.safetensors_loader import load_hf_checkpoint
from model.factory import build_model
from model.vision_loader import load_vision_tower
from serving.gateway.media.image_processing import pixel_digest, preprocess
from tests.support.hf_tiny_parity import ATOL, DATA, agree_until_near_tie, golden, prefill_then_greedy

CASE = DATA / "gemma3_vision"


@pytest.fixture(scope="module")
def tower():
    return load_vision_tower(CASE)


@pytest.fixture(scope="module")
def decoder():
    cfg, params = load_hf_checkpoint(CASE, dtype="float32", progress=False)
    return build_model(cfg, params=params, dtype=jnp.float32)


def image_spans(prompt: list[int], image_id: int) -> np.ndarray:
    """[T, 2] (start, end) of each image token's run of placeholders; (0, 0) for text."""
    spans = np.zeros((len(prompt), 2), np.int32)
    t = 0
    while t < len(prompt):
        if prompt[t] == image_id:
            end = t
            while end < len(prompt) and prompt[end] == image_id:
                end += 1
            spans[t:end] = (t, end)
            t = end
        else:
            t += 1
    return spans


def test_preprocessing_equals_the_processors_pixels():
    want = np.load(CASE / "pixel_values.npy")
    size = read_vision_config(__import__("json").loads((CASE / "config.json").read_text())).siglip.image_size
    for i, name in enumerate(golden("gemma3_vision")["images"]):
        with Image.open(CASE / name) as im:
            got = preprocess(im, size)
        assert got.shape == want[i].shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want[i], atol=1e-6, rtol=0)
    assert pixel_digest(want[0]) != pixel_digest(want[1])
    assert pixel_digest(want[0]) == pixel_digest(want[0].copy())


def test_image_features_match_transformers(tower):
    cfg = tower.cfg
    assert (cfg.siglip.patches_per_side, cfg.tokens_per_side, cfg.pool_kernel) == (8, 4, 2)
    feats = np.asarray(encode_images(tower, jnp.asarray(np.load(CASE / "pixel_values.npy"))))
    want = np.load(CASE / "image_features.npy")
    assert feats.shape == want.shape == (2, 16, 48)
    err = np.abs(feats - want).max()
    assert err <= ATOL, f"image features differ from transformers' by {err:.2e}"
    assert np.abs(want).max() > 1.0
    # one image alone encodes as in the batch (no cross-image mixing)
    one = np.asarray(encode_images(tower, jnp.asarray(np.load(CASE / "pixel_values.npy")[1:])))
    np.testing.assert_allclose(one[0], feats[1], atol=ATOL, rtol=0)


def test_logits_and_greedy_ids_with_images_match_transformers(tower, decoder):
    ref = golden("gemma3_vision")
    prompt = ref["prompt"]
    image_id = tower.cfg.image_token_id
    assert ref["token_type_ids"] == [int(t == image_id) for t in prompt]
    feats = np.asarray(encode_images(tower, jnp.asarray(np.load(CASE / "pixel_values.npy"))))
    embeds = np.zeros((len(prompt), decoder.cfg.hidden_size), np.float32)
    embeds[np.asarray(prompt) == image_id] = feats.reshape(-1, feats.shape[-1])
    spans = image_spans(prompt, image_id)
    assert spans[3 + 1].tolist() == [4, 20] and spans[0].tolist() == [0, 0]
    logits, ids, step_logits = prefill_then_greedy(decoder, prompt, len(ref["greedy"]["ids"]),
                                                   image_embeds=embeds, image_spans=spans)
    want = np.load(CASE / "logits.npy")
    err = np.abs(logits - want).max()
    assert err <= ATOL, f"prompt logits differ from transformers' by {err:.2e}"
    compared = agree_until_near_tie(ids, ref, "gemma3_vision")
    assert compared == len(ref["greedy"]["ids"])
    err = np.abs(step_logits - np.load(CASE / "greedy_logits.npy")).max()
    assert err <= ATOL, f"decode-step logits differ from transformers' by {err:.2e}"

    # Each ingredient shows: causal attention only inside the images, or the placeholders'
    # own embeddings instead of the soft tokens, gives other logits.
    own = np.arange(len(prompt), dtype=np.int32)  # each image token's span: itself (causal)
    causal_spans = np.where(spans[:, 1:] > spans[:, :1], np.stack([own, own + 1], 1), 0).astype(np.int32)
    causal, _, _ = prefill_then_greedy(decoder, prompt, 1, image_embeds=embeds, image_spans=causal_spans)
    assert np.abs(causal - want).max() > 1e-2
    text_only, _, _ = prefill_then_greedy(decoder, prompt, 1)
    assert np.abs(text_only - want).max() > 1e-2


def test_image_spans_need_the_xla_kernel_and_a_prefill_step():
    from kernels_pallas.attention import AttentionConfig, paged_attention
    from model.attention_metadata import AttentionMetadata

    md = AttentionMetadata(slot_mapping=jnp.zeros(4, jnp.int32), page_table=jnp.ones((1, 1), jnp.int32),
                           kv_lens=jnp.asarray([4]), cu_q_lens=jnp.asarray([0, 4]),
                           num_seqs=jnp.asarray(1), mode="prefill")
    q = jnp.zeros((4, 2, 8))
    pages = jnp.zeros((1, 2, 8, 8))
    with pytest.raises(ValueError, match="xla attention kernel"):
        paged_attention(q, pages, pages, md, scale=1.0, config=AttentionConfig("triton", interpret=True),
                        bidirectional_spans=jnp.zeros((4, 2), jnp.int32))
