"""``POST /v1/embeddings`` on an embedding model (``serve --task embed``).

Per request: validate (``schema/embeddings.py``) -> the model must serve embeddings (a generation
model's name is a 400 ``model_not_supported``) -> ``dimensions`` only for a Matryoshka model, and
only one of its trained sizes (else 400 naming them) -> tokenize each string input as the model's
tokenizer frames it alone (``encode_input``: BOS / EOS as sentence-transformers adds them), in a
worker thread; token-id inputs are used as they are -> every input within the model's length and
its ids inside the vocabulary (400 naming the input) -> rate limits and metering (one ledger row,
``prompt_tokens`` = all inputs' tokens, no completion) -> the input policies (string inputs; a
rejection is a metered 400 ``content_policy_violation``) -> the embedding engine
(``EmbeddingClient.embed``, batched with other requests' inputs) -> truncation to ``dimensions``
and re-normalization (the L2 norm of the kept prefix, as OpenAI's ``text-embedding-3`` returns
unit vectors of any size) -> floats, or base64 of little-endian float32.

A client that disconnects while its inputs wait is metered as cancelled. Nothing here imports JAX.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import ANONYMOUS, Principal
from serving.gateway.accounts.rate_limit import RateLimited
from serving.gateway.http.disconnect import ClientDisconnected, until_disconnect
from serving.gateway.http.errors import OpenAIError, rate_limited
from serving.gateway.http.request_scope import RATE_LIMIT_HEADERS_SCOPE_KEY, request_id_of
from serving.gateway.openai.openai_serving import OpenAIServing, read_json
from serving.gateway.openai.served_model import ServedModel
from serving.gateway.schema.embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from serving.gateway.services.policy import PolicyViolation

logger = logging.getLogger("xlaserve.gateway")

EMBEDDINGS_PATH = "/v1/embeddings"

__all__ = ["EMBEDDINGS_PATH", "EmbeddingServing", "encode_vectors", "truncate"]


def truncate(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first ``dimensions`` of each vector, re-normalized to unit L2 norm (Matryoshka).

    Args:
      vectors: [n, dim] float32.
      dimensions: 1 .. dim, or None (unchanged).
    """
    if dimensions is None or dimensions == vectors.shape[1]:
        return vectors
    kept = vectors[:, :dimensions]
    return kept / np.maximum(np.linalg.norm(kept, axis=1, keepdims=True), 1e-12)


def encode_vectors(vectors: np.ndarray, encoding_format: str) -> list[list[float] | str]:
    """Each row as a list of floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return [base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii") for v in vectors]
    return [[float(x) for x in v] for v in vectors.astype(np.float32)]


class EmbeddingServing:
    """The ``/v1/embeddings`` handler, sharing ``OpenAIServing``'s models, services and
    tokenizer workers."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    @staticmethod
    def _check_dimensions(served: ServedModel, dimensions: int | None) -> None:
        if dimensions is None or dimensions == served.embedding_dim:
            return
        if not served.matryoshka_dims:
            raise OpenAIError(f"The model `{served.name}` is not a Matryoshka model: it returns "
                              f"{served.embedding_dim} dimensions and cannot return {dimensions}.",
                              param="dimensions", code="invalid_value")
        if dimensions not in served.matryoshka_dims:
            sizes = ", ".join(str(d) for d in sorted(set(served.matryoshka_dims) | {served.embedding_dim}))
            raise OpenAIError(f"'dimensions' must be one of the sizes the model `{served.name}` was trained "
                              f"for ({sizes}); got {dimensions}.", param="dimensions", code="invalid_value")

    def _check_input(self, served: ServedModel, i: int, ids: list[int], many: bool) -> None:
        where = f"'input' item {i}" if many else "'input'"
        limit = served.max_model_len
        if not ids:
            raise OpenAIError(f"{where} has no tokens.", param="input", code="invalid_value")
        if len(ids) > limit:
            raise OpenAIError(f"This model's maximum input length is {limit} tokens. However, {where} has "
                              f"{len(ids)} tokens. Please shorten it.", param="input",
                              code="context_length_exceeded")
        vocab = served.tokenizer.vocab_size if served.vocab_size is None else served.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(f"{where} has token id {bad}, outside the vocabulary (0..{vocab - 1}).",
                              param="input", code="invalid_value")

    async def _tokenize(self, served: ServedModel, req: EmbeddingRequest) -> list[list[int]]:
        tok = served.tokenizer
        encode = getattr(tok, "encode_input", None) or (lambda text: tok.encode(text, add_bos=True))
        limit = self.serving.limits.max_prompt_chars
        out = []
        many = len(req.inputs) > 1
        for i, item in enumerate(req.inputs):
            if isinstance(item, str):
                if len(item) > limit:
                    raise OpenAIError(f"{f'input item {i}' if many else 'input'} has {len(item)} characters; "
                                      f"this server takes at most {limit}.", param="input",
                                      code="invalid_value")
                ids = await self.serving.prompts.run(encode, item)
            else:
                ids = list(item)
            self._check_input(served, i, ids, many)
            out.append(ids)
        return out

    async def create_embedding(self, request: Request, principal: Principal = ANONYMOUS) -> Response:
        """``POST /v1/embeddings``.

        Raises:
          OpenAIError: 400 (a generation model, ``dimensions`` for a model that is not
            Matryoshka or not one of its sizes, an input too long or with ids outside the
            vocabulary), 403 / 404 (model), 429 (rate limit).
          pydantic.ValidationError: invalid fields (turned into 400).
          EngineOverloadedError (503), RequestRejectedError (400): from the engine.
          ClientDisconnected: the client went away.
        """
        arrival = time.time()
        raw = await read_json(request)
        req = EmbeddingRequest.model_validate(raw)
        # A Batch API line runs with "priority": "batch" (batch_runner.py), behind interactive work.
        priority = "batch" if isinstance(raw, dict) and raw.get("priority") == "batch" else "interactive"
        served = self.serving.model(req.model, principal)
        if served.task != "embed":
            raise OpenAIError(f"The model `{served.name}` generates text; it does not serve embeddings "
                              f"(start an embedding model with `xlaserve serve --task embed`).",
                              param="model", code="model_not_supported")
        self._check_dimensions(served, req.dimensions)
        inputs = await self._tokenize(served, req)
        prompt_tokens = sum(len(ids) for ids in inputs)
        rid, given = request_id_of(request)
        response_id = f"embd-{uuid.uuid4().hex if given else rid}"
        logger.info("request %s (X-Request-ID %s): model=%s embeddings inputs=%d prompt_tokens=%d",
                    response_id, rid, served.name, len(inputs), prompt_tokens)
        services = self.serving.services
        try:
            meter = await services.metering.admit_async(principal, response_id, rid, served.name, priority,
                                                        False, arrival, prompt_tokens, 0)
        except RateLimited as e:
            logger.info("request %s rate limited: %s %s limit", response_id, e.scope, e.limit)
            raise rate_limited(e) from None
        request.scope[RATE_LIMIT_HEADERS_SCOPE_KEY] = meter.admission.headers
        try:
            services.policies.check_input([item for item in req.inputs if isinstance(item, str)])
        except PolicyViolation as e:
            meter.note("input_policy", policy=e.policy)
            await meter.finish("error", error=f"content_policy_violation ({e.policy})")
            raise OpenAIError(str(e), code="content_policy_violation", param="input") from None
        try:
            vectors = await until_disconnect(request, served.engine.embed(
                inputs, priority="batch" if priority == "batch" else "default"))
        except ClientDisconnected:
            await meter.finish("cancelled", error="client disconnected")
            raise
        except BaseException as e:
            await meter.finish("error", error=f"{type(e).__name__}: {e}")
            raise
        meter.prefilled = True
        meter.note("embedded", inputs=len(inputs))
        await meter.finish("ok", "stop")
        vectors = truncate(np.asarray(vectors, np.float32), req.dimensions)
        data = [EmbeddingData(index=i, embedding=e) for i, e in enumerate(encode_vectors(vectors, req.encoding_format))]
        body = EmbeddingResponse(data=data, model=req.model,
                                 usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
        return JSONResponse(body.model_dump(mode="json"))
