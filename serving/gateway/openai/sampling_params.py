"""A validated request's sampling fields as the engine's :class:`SamplingParams`.

The request models (``protocol.py``) check what needs no model; this adds the
checks that need the tokenizer (token ids inside the vocabulary, each a 400
naming its field) and the mapping:

- ``top_k``: 0, -1, or any k at or above the vocabulary size means off (0).
- ``stop_token_ids`` join the model's stop ids (chat: the chat stop ids).
- ``ignore_eos`` (vLLM's): the model's own stop ids are left out; the caller's
  ``stop_token_ids`` still end the output. The engine is therefore asked with
  ``ignore_eos`` only when no caller id remains (its ``ignore_eos`` drops every
  stop id), else with exactly the caller's ids: what ends generation on the
  device is what leaves the text (docs/design/sampling-on-device.md, "Stop
  conditions").
- ``logit_bias`` keys become ids; ``repetition_penalty``, ``min_p``,
  ``min_tokens`` and the penalties pass through (absent: neutral).
- ``logprobs``: the engine is asked for the top-k it needs (completions'
  ``logprobs``; chat's ``top_logprobs``, 0 when only ``logprobs: true``;
  ``best_of`` ranking needs at least 0, i.e. the token's own logprob).
- ``prompt_logprobs``: asked for with ``echo`` and ``logprobs``, and for
  ``max_tokens: 0`` (the prompt only), where the engine requires it.

Seeds per choice (``seed + j`` for choice j of a prompt) are ``choices.py``'s.
"""

from __future__ import annotations

from typing import Iterable

from serving.contract.engine_client import SamplingParams, StructuredOutput
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.gateway.http.errors import OpenAIError
from serving.gateway.schema.protocol import ChatCompletionRequest, CompletionRequest


def _check_ids(ids: Iterable[int], vocab: int, field: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise OpenAIError(f"Token id {bad} in '{field}' is outside the vocabulary [0, {vocab}).",
                          param=field)


def engine_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The ``SamplingParams.logprobs`` a request needs (None: none)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is not None:
        return req.logprobs
    return 0 if (req.best_of or 1) > req.n else None


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    tok: TextTokenizer, structured_output: StructuredOutput | None = None) -> SamplingParams:
    """The engine's settings for one choice of `req` (seed: the request's own).

    Args:
      max_tokens: the completion budget already resolved (>= 0; 0 only for
        an echo of the prompt).
      structured_output: the constraint (None: the request's own, if any;
        a forced tool call passes its schema here).

    Raises:
      OpenAIError: 400 naming ``logit_bias`` or ``stop_token_ids`` for a token
        id outside ``[0, tok.vocab_size)``; 400 naming ``min_tokens`` when it
        exceeds `max_tokens` (the default one: an explicit one is refused by
        the request model).
    """
    vocab = tok.vocab_size
    if req.min_tokens and req.min_tokens > max_tokens:
        raise OpenAIError(f"'min_tokens' ({req.min_tokens}) must not exceed the completion's "
                          f"max_tokens ({max_tokens}).", param="min_tokens")
    chat = isinstance(req, ChatCompletionRequest)
    bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    _check_ids((i for i, _ in bias), vocab, "logit_bias")
    extra_stops = tuple(req.stop_token_ids or ())
    _check_ids(extra_stops, vocab, "stop_token_ids")
    model_stops = () if req.ignore_eos else (tok.chat_stop_token_ids if chat else tok.stop_token_ids)
    stops = tuple(dict.fromkeys((*model_stops, *extra_stops)))
    top_k = req.top_k if req.top_k is not None and 0 < req.top_k < vocab else 0
    logprobs = engine_logprobs(req)
    prompt_logprobs = None
    if not chat and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    elif max_tokens == 0:
        prompt_logprobs = 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_k=top_k,
        top_p=1.0 if req.top_p is None else float(req.top_p),
        min_p=0.0 if req.min_p is None else float(req.min_p),
        seed=req.seed,
        stop_token_ids=stops,
        ignore_eos=bool(req.ignore_eos) and not stops,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        logit_bias=bias,
        min_tokens=req.min_tokens or 0,
        num_speculative_tokens=getattr(req, "num_speculative_tokens", None),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        # The structured-output fields' parsed constraint (their own module), when present.
        structured_output=structured_output or getattr(req, "structured_output", None),
    )
