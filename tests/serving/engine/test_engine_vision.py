"""Gemma 3 vision through the engine loop (tests/data/hf_tiny/gemma3_vision; transformers'
outputs recorded by make_vision_fixtures.py): a prompt with two images, prefilled in 16-token
chunks that must not end inside an image, decodes transformers' greedy ids; the encoder cache
and the prefix cache tell the images apart by their pixels."""

from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest

from model.factory import build_model
from model.safetensors_loader import load_hf_checkpoint
from model.vision_loader import load_vision_tower
from serving.config.engine_config import EngineConfig
from serving.contract.engine_client import EngineRequest, ImageInput, RequestRejectedError, SamplingParams
from serving.core.sched.sched_request import SchedRequest
from serving.core.sched.scheduler import Scheduler
from serving.engine.engine import Engine
from serving.gateway.media.image_processing import pixel_digest
from serving.runtime import sampling_request
from serving.runtime.engine_loop import EngineLoop
from tests.support.engine_helpers import collect
from tests.support.hf_tiny_parity import DATA, agree_until_near_tie, golden

CASE = DATA / "gemma3_vision"
IMAGE_ID = 255


def images_of(prompt: list[int], pixels: list[np.ndarray]) -> tuple[ImageInput, ...]:
    starts = [t for t in range(len(prompt)) if prompt[t] == IMAGE_ID and (t == 0 or prompt[t - 1] != IMAGE_ID)]
    return tuple(ImageInput(s, 16, pixel_digest(p), p) for s, p in zip(starts, pixels))


@pytest.fixture(scope="module")
def loop():
    cfg, params = load_hf_checkpoint(CASE, progress=False)
    engine = Engine(build_model(cfg, params=params, dtype=jnp.float32),
                    EngineConfig(max_slots=2, num_pages=32, max_model_len=96, page_size=8, prefill_chunk=16,
                                 min_decode_batch=2, kv_dtype="float32"),
                    vision=load_vision_tower(CASE))
    loop = EngineLoop(engine)
    loop.start(warmup=False)
    yield loop
    loop.stop()


def run(loop, *reqs):
    async def main():
        return await asyncio.gather(*(collect(loop, r) for r in reqs))

    return asyncio.run(main())


def req(prompt, images, rid, n=12):
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                           logprobs=0), images=images)


def logprobs(events) -> np.ndarray:
    return np.asarray([lp.logprob for ev in events for lp in (ev.logprobs or ())])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_chunks_never_end_inside_an_image():
    ref = golden("gemma3_vision")
    sr = SchedRequest("r", list(ref["prompt"]), 4, images=((4, 20, "a"), (25, 41, "b")))
    fit = Scheduler._fit_images
    assert fit(sr, 0, 16) == 4          # [0, 16) would end inside image a: cut at its start
    assert fit(sr, 4, 16) == 16         # the whole image
    assert fit(sr, 4, 10) == 0          # starts at the image, cannot take it whole: wait
    assert fit(sr, 20, 16) == 5         # cut at image b
    assert fit(sr, 10, 8) == 0          # (mid-image start, after a prefix hit) must reach its end
    assert fit(sr, 10, 16) == 15        # ... and then stops before image b
    assert fit(sr, 41, 5) == 5


def test_greedy_with_images_matches_transformers_and_caches_tell_images_apart(loop):
    ref = golden("gemma3_vision")
    prompt = ref["prompt"]
    pixels = list(np.load(CASE / "pixel_values.npy"))
    enc = loop.engine.vision
    (ids, events), = run(loop, req(prompt, images_of(prompt, pixels), "first"))
    assert agree_until_near_tie(ids, ref, "gemma3_vision engine") == len(ref["greedy"]["ids"])
    # each chosen token's log probability: transformers' logits' log-softmax, within 1e-4
    want = log_softmax(np.load(CASE / "greedy_logits.npy"))[np.arange(len(ids)), ids]
    np.testing.assert_allclose(logprobs(events), want, atol=1e-4, rtol=0)
    assert (enc.misses, enc.hits) == (2, 0)
    assert events[-1].cached_tokens == 0

    # The same images again: the prompt's pages from the prefix cache (image a's tokens all
    # cached, so it is not even looked up), image b's soft tokens (its last token is in the
    # recomputed tail) from the encoder cache; the same ids.
    (again, events), = run(loop, req(prompt, images_of(prompt, pixels), "again"))
    assert again == ids and (enc.misses, enc.hits) == (2, 1)
    np.testing.assert_allclose(logprobs(events), want, atol=1e-4, rtol=0)
    assert events[-1].cached_tokens == 40  # 5 whole pages of the 46-token prompt

    # Other pixels in the second image: encoded anew; the pages up to the one holding its
    # first token are shared, none from there on; the answer differs.
    other = pixels[1][:, ::-1].copy()
    (_, events), = run(loop, req(prompt, images_of(prompt, [pixels[0], other]), "other"))
    assert (enc.misses, enc.hits) == (3, 1)
    assert events[-1].cached_tokens == 24  # pages 0-2 ([0, 24)); image b starts at 25
    assert np.abs(logprobs(events) - want).max() > 1e-3


def test_requests_with_bad_images_are_refused(loop):
    ref = golden("gemma3_vision")
    prompt = ref["prompt"]
    p = np.load(CASE / "pixel_values.npy")[0]
    with pytest.raises(RequestRejectedError, match="must hold the image token id"):
        loop.submit(req(prompt, (ImageInput(0, 16, "x", p),), "bad-span"))
    with pytest.raises(RequestRejectedError, match="takes 16 soft tokens"):
        loop.submit(req(prompt, (ImageInput(4, 8, "x", p),), "bad-count"))
    with pytest.raises(RequestRejectedError, match="overlap another image"):
        loop.submit(req(prompt, (ImageInput(4, 16, "x", p), ImageInput(4, 16, "y", p)), "overlap"))
    good = req(prompt, images_of(prompt, [p, p]), "fits")
    sampling_request.validate_images(good, loop.engine.vision, 16)
    with pytest.raises(RequestRejectedError, match="exceed what one prefill step takes"):
        sampling_request.validate_images(good, loop.engine.vision, 15)
    with pytest.raises(RequestRejectedError, match="takes no image inputs"):
        sampling_request.validate_images(good, None, 16)
    from serving.rpc.convert import request_to_proto

    with pytest.raises(RequestRejectedError, match="not sent to remote engine replicas"):
        request_to_proto(good)  # the replica protocol carries no pixels: refused, never dropped
