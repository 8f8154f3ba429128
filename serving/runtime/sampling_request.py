"""A request as the engine takes it: checked (``validate_request``), and its ``SamplingParams``
turned into the engine's per-row ``SamplingSettings`` (host side).

Validates what the device arrays can hold (fixed widths, int32 and float32
ranges, token ids inside the vocabulary) so that a bad value is a
:class:`~serving.contract.engine_client.RequestRejectedError` with a message naming the
field (the gateway answers 400), never a failed step. The gateway checks the
API's own bounds first; these checks hold for every caller of the engine.
"""

from __future__ import annotations

import math
from typing import Callable, Container

from serving.contract.engine_client import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    EngineRequest,
    RequestRejectedError,
    SamplingParams,
)
from serving.core.sched.step_plan import SamplingSettings
from serving.engine.sample.sampling import MAX_SUPPRESS_IDS

_INT32_MAX = 2**31 - 1


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise RequestRejectedError(f"{name} must be a finite number, got {value}")
    return value


def validate_request(request: EngineRequest, vocab: int, max_model_len: int, usable_pages: int,
                     pages_needed: Callable[[int], int], priorities: Container[str]) -> None:
    """Checks a whole request against what the engine can serve: its prompt (non-empty, ids
    inside the vocabulary), prompt plus ``max_tokens`` against the context window and the KV
    cache (``pages_needed(tokens)`` of its ``usable_pages``), its priority, its sampling.

    Raises:
      RequestRejectedError: naming what does not fit.
    """
    n = len(request.prompt_ids)
    s = request.sampling
    if n == 0:
        raise RequestRejectedError("the prompt is empty")
    validate(s, vocab, () if s.ignore_eos else tuple(s.stop_token_ids))
    if s.num_speculative_tokens is not None and s.num_speculative_tokens < 0:
        raise RequestRejectedError(f"num_speculative_tokens must be >= 0, got {s.num_speculative_tokens}")
    if n + s.max_tokens > max_model_len:
        raise RequestRejectedError(
            f"prompt ({n} tokens) plus max_tokens ({s.max_tokens}) exceeds the context "
            f"window of {max_model_len} tokens")
    pages = pages_needed(n + s.max_tokens)
    if pages > usable_pages:
        raise RequestRejectedError(
            f"prompt ({n} tokens) plus max_tokens ({s.max_tokens}) needs {pages} KV-cache pages "
            f"but the cache has {usable_pages}; "
            + ("lower max_tokens" if pages_needed(n) <= usable_pages else "shorten the prompt"))
    if request.priority not in priorities:
        raise RequestRejectedError(f"priority must be one of {sorted(priorities)}")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
    if bad:
        raise RequestRejectedError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")


def validate_images(request: EngineRequest, encoder, prefill_chunk: int) -> None:
    """Checks a prompt's images (``EngineRequest.images``) against the engine's vision tower
    (``serving.engine.vision_inputs.ImageEncoder``, None: the model takes no images) and the
    most prompt tokens one step computes (``prefill_chunk``).

    Raises:
      RequestRejectedError: no vision tower; an image's soft-token count is not the tower's,
        its span leaves the prompt, overlaps another, does not hold the image token id,
        or is longer than a prefill chunk (an image is computed in one step).
    """
    if encoder is None:
        raise RequestRejectedError("this model takes no image inputs")
    image_id = encoder.cfg.image_token_id
    prompt = request.prompt_ids
    last_end = 0
    for i, im in enumerate(request.images):
        if im.num_tokens != encoder.tokens_per_image:
            raise RequestRejectedError(f"image {i}: takes {encoder.tokens_per_image} soft tokens, "
                                       f"got {im.num_tokens}")
        if im.start < last_end or im.end > len(prompt):
            raise RequestRejectedError(f"image {i}: its tokens [{im.start}, {im.end}) overlap another "
                                       f"image or leave the {len(prompt)}-token prompt")
        if any(prompt[p] != image_id for p in range(im.start, im.end)):
            raise RequestRejectedError(f"image {i}: positions [{im.start}, {im.end}) must hold the "
                                       f"image token id {image_id}")
        if im.num_tokens > prefill_chunk:
            raise RequestRejectedError(f"image {i}: {im.num_tokens} soft tokens exceed what one prefill step "
                                       f"takes ({prefill_chunk}); an image is computed in one step")
        last_end = im.end


def validate(s: SamplingParams, vocab: int, stop_ids: tuple[int, ...]) -> None:
    """Checks ``s`` against what the engine can serve.

    Args:
      s: the request's sampling parameters.
      vocab: the model's vocabulary size.
      stop_ids: the ids that stop the request (suppressed while ``min_tokens`` is unmet).

    Raises:
      RequestRejectedError: naming the field.
    """
    if s.max_tokens < 0 or (s.max_tokens == 0 and s.prompt_logprobs is None):
        raise RequestRejectedError("max_tokens must be >= 1 (0 only with prompt_logprobs)")
    if _finite("temperature", s.temperature) < 0:
        raise RequestRejectedError(f"temperature must be >= 0, got {s.temperature}")
    if not 0 <= s.top_k <= _INT32_MAX:
        raise RequestRejectedError(f"top_k must be in [0, {_INT32_MAX}] (0: off), got {s.top_k}")
    if not 0 < _finite("top_p", s.top_p) <= 1:
        raise RequestRejectedError(f"top_p must be in (0, 1], got {s.top_p}")
    if not 0 <= _finite("min_p", s.min_p) <= 1:
        raise RequestRejectedError(f"min_p must be in [0, 1], got {s.min_p}")
    _finite("presence_penalty", s.presence_penalty)
    _finite("frequency_penalty", s.frequency_penalty)
    if _finite("repetition_penalty", s.repetition_penalty) <= 0:
        raise RequestRejectedError(f"repetition_penalty must be > 0, got {s.repetition_penalty}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise RequestRejectedError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(s.logit_bias)}")
    for token, bias in s.logit_bias:
        if not 0 <= token < vocab:
            raise RequestRejectedError(f"logit_bias token ids must be in [0, {vocab}), got {token}")
        _finite("logit_bias values", bias)
    if not 0 <= s.min_tokens <= max(s.max_tokens, 0):
        raise RequestRejectedError(f"min_tokens must be in [0, max_tokens={s.max_tokens}], got {s.min_tokens}")
    if s.min_tokens > 0 and len(stop_ids) > MAX_SUPPRESS_IDS:
        raise RequestRejectedError(
            f"min_tokens with more than {MAX_SUPPRESS_IDS} stop token ids (EOS included) is not "
            f"supported, got {len(stop_ids)}")
    if any(not 0 <= t < vocab for t in stop_ids):
        raise RequestRejectedError(f"stop_token_ids must be in [0, {vocab})")
    for name, k in (("logprobs", s.logprobs), ("prompt_logprobs", s.prompt_logprobs)):
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise RequestRejectedError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")


def settings(s: SamplingParams, seed: int, vocab: int, stop_ids: tuple[int, ...]) -> SamplingSettings:
    """The engine's row settings for validated ``s`` (see :func:`validate`).

    Args:
      s: the request's sampling parameters.
      seed: the request's seed (already drawn when ``s.seed`` is None), modulo 2**32.
      vocab: the vocabulary size: a top_k at or above it means no top-k (0).
      stop_ids: the request's stop ids (suppressed while ``min_tokens`` is unmet).
    """
    return SamplingSettings(
        temperature=float(s.temperature), top_k=int(s.top_k) if s.top_k < vocab else 0,
        top_p=float(s.top_p), seed=seed, min_p=float(s.min_p),
        presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty),
        repetition_penalty=float(s.repetition_penalty),
        logit_bias=tuple((int(t), float(b)) for t, b in s.logit_bias),
        min_tokens=int(s.min_tokens), suppress_ids=tuple(stop_ids) if s.min_tokens > 0 else (),
        logprobs=-1 if s.logprobs is None else int(s.logprobs),
        prompt_logprobs=-1 if s.prompt_logprobs is None else int(s.prompt_logprobs))
