"""The rerank and score handlers and their routes, on a ``--task rerank`` model.

Per request: validate (``rerank_protocol.py``) -> the model must rerank (another task's name is a
400 ``model_not_supported``) -> frame each (query, document) pair with the model's pair encoder
(``ServedModel.pair_encoder``: a cross-encoder's tokenizer, or a decoder reranker's prompt), in a
worker thread -> every pair within the model's length (400 ``context_length_exceeded`` naming
the document) -> rate limits and metering (one ledger row, ``prompt_tokens`` = all framed
pairs' tokens, no completion) -> the input policies (a rejection is a metered 400
``content_policy_violation``) -> the engine (``ScoringClient.score``, batched with other
requests' inputs as embeddings are) -> results. A client that disconnects while its pairs wait
is metered as cancelled. A Batch API line (``"priority": "batch"``) runs behind interactive work.
"""

from __future__ import annotations

import logging
import time
import uuid

import numpy as np
from fastapi import Depends, FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import ANONYMOUS, Principal
from serving.gateway.accounts.rate_limit import RateLimited
from serving.gateway.http.disconnect import ClientDisconnected, until_disconnect
from serving.gateway.http.errors import OpenAIError, rate_limited
from serving.gateway.http.openapi import json_request_body
from serving.gateway.http.request_scope import RATE_LIMIT_HEADERS_SCOPE_KEY, request_id_of
from serving.gateway.openai.openai_serving import OpenAIServing, read_json
from serving.gateway.openai.served_model import ServedModel
from serving.gateway.rerank.rerank_protocol import (RerankDocument, RerankRequest, RerankResponse, RerankResult,
                                                    RerankUsage, ScoreData, ScoreRequest, ScoreResponse)
from serving.gateway.services.policy import PolicyViolation

logger = logging.getLogger("xlaserve.gateway")

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
SCORE_PATHS = ("/v1/score", "/score")

__all__ = ["RERANK_PATHS", "SCORE_PATHS", "RerankServing", "install_rerank_api"]


class RerankServing:
    """The rerank and score handlers, sharing ``OpenAIServing``'s models, services and tokenizer
    workers."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _reranker(self, name: str, principal: Principal) -> ServedModel:
        served = self.serving.model(name, principal)
        if served.task != "rerank" or served.pair_encoder is None:
            raise OpenAIError(f"The model `{served.name}` does not rerank (start a cross-encoder or a decoder "
                              f"reranker with `xlaserve serve --task rerank`).", param="model",
                              code="model_not_supported")
        return served

    async def _frame(self, served: ServedModel, pairs: list[tuple[str, str]], param: str,
                     ) -> tuple[list[list[int]], list[int]]:
        limit = self.serving.limits.max_prompt_chars
        inputs, starts = [], []
        for i, (query, doc) in enumerate(pairs):
            if len(query) + len(doc) > limit:
                raise OpenAIError(f"Pair {i} has {len(query) + len(doc)} characters; this server takes at most "
                                  f"{limit}.", param=param, code="invalid_value")
            ids, start = await self.serving.prompts.run(served.pair_encoder.encode_pair, query, doc)
            if len(ids) > served.max_model_len:
                raise OpenAIError(f"This model's maximum input length is {served.max_model_len} tokens. However, "
                                  f"pair {i} (with {param} item {i}) has {len(ids)} tokens. Please shorten it.",
                                  param=param, code="context_length_exceeded")
            inputs.append(ids)
            starts.append(start)
        return inputs, starts

    async def _scores(self, request: Request, principal: Principal, raw, served: ServedModel,
                      pairs: list[tuple[str, str]], param: str, prefix: str) -> tuple[np.ndarray, int, str]:
        """Frames, meters and scores ``pairs``; returns (scores [n] f32, prompt tokens, response id)."""
        arrival = time.time()
        priority = "batch" if isinstance(raw, dict) and raw.get("priority") == "batch" else "interactive"
        inputs, starts = await self._frame(served, pairs, param)
        prompt_tokens = sum(len(ids) for ids in inputs)
        rid, given = request_id_of(request)
        response_id = f"{prefix}-{uuid.uuid4().hex if given else rid}"
        logger.info("request %s (X-Request-ID %s): model=%s %s pairs=%d prompt_tokens=%d", response_id, rid,
                    served.name, prefix, len(inputs), prompt_tokens)
        services = self.serving.services
        try:
            meter = await services.metering.admit_async(principal, response_id, rid, served.name, priority,
                                                        False, arrival, prompt_tokens, 0)
        except RateLimited as e:
            logger.info("request %s rate limited: %s %s limit", response_id, e.scope, e.limit)
            raise rate_limited(e) from None
        request.scope[RATE_LIMIT_HEADERS_SCOPE_KEY] = meter.admission.headers
        try:
            services.policies.check_input(list(dict.fromkeys(t for pair in pairs for t in pair)))
        except PolicyViolation as e:
            meter.note("input_policy", policy=e.policy)
            await meter.finish("error", error=f"content_policy_violation ({e.policy})")
            raise OpenAIError(str(e), code="content_policy_violation", param=param) from None
        try:
            scores = await until_disconnect(request, served.engine.score(
                inputs, starts, priority="batch" if priority == "batch" else "default"))
        except ClientDisconnected:
            await meter.finish("cancelled", error="client disconnected")
            raise
        except BaseException as e:
            await meter.finish("error", error=f"{type(e).__name__}: {e}")
            raise
        meter.prefilled = True
        meter.note("scored", pairs=len(inputs))
        await meter.finish("ok", "stop")
        return np.asarray(scores, np.float32), prompt_tokens, response_id

    async def rerank(self, request: Request, principal: Principal = ANONYMOUS) -> Response:
        """``POST /v1/rerank`` (``/rerank``, ``/v2/rerank``).

        Raises:
          OpenAIError: 400 (not a rerank model, a pair too long), 403 / 404 (model), 429 (rate limit).
          pydantic.ValidationError: invalid fields (turned into 400).
          EngineOverloadedError (503), RequestRejectedError (400): from the engine.
          ClientDisconnected: the client went away.
        """
        raw = await read_json(request)
        req = RerankRequest.model_validate(raw)
        served = self._reranker(req.model, principal)
        texts = req.texts
        scores, tokens, rid = await self._scores(request, principal, raw, served, [(req.query, t) for t in texts],
                                                 "documents", "rerank")
        order = sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i))
        if req.top_n:
            order = order[:req.top_n]
        results = [RerankResult(index=i, relevance_score=float(scores[i]),
                                document=RerankDocument(text=texts[i]) if req.return_documents else None)
                   for i in order]
        body = RerankResponse(id=rid, model=req.model, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))
        return JSONResponse(body.model_dump(mode="json", exclude_none=True))

    async def score(self, request: Request, principal: Principal = ANONYMOUS) -> Response:
        """``POST /v1/score`` (``/score``). Raises what :meth:`rerank` does; 400 for a ``text_1``
        list of neither one text nor as many as ``text_2``."""
        raw = await read_json(request)
        req = ScoreRequest.model_validate(raw)
        served = self._reranker(req.model, principal)
        try:
            pairs = req.pairs()
        except ValueError as e:
            raise OpenAIError(str(e), param="text_1", code="invalid_value") from None
        scores, tokens, rid = await self._scores(request, principal, raw, served, pairs, "text_2", "score")
        body = ScoreResponse(id=rid, model=req.model, data=[ScoreData(index=i, score=float(s))
                                                            for i, s in enumerate(scores)],
                             usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))
        return JSONResponse(body.model_dump(mode="json"))


def install_rerank_api(app: FastAPI, serving: OpenAIServing, principal, errors: dict) -> RerankServing:
    """Adds the rerank and score routes (:data:`RERANK_PATHS`, :data:`SCORE_PATHS`) to ``app``;
    returns their handlers.

    Args:
      principal: the FastAPI dependency that authenticates callers.
      errors: the error responses the routes document.
    """
    handlers = RerankServing(serving)

    def route(path: str, model: type[BaseModel], response: type[BaseModel], fn) -> None:
        async def endpoint(request: Request, caller: Principal = Depends(principal)) -> Response:
            return await fn(request, caller)

        endpoint.__name__ = "create_" + path.strip("/").replace("/", "_")
        app.post(path, openapi_extra=json_request_body(model), response_model=response, responses=errors)(endpoint)

    for path in RERANK_PATHS:
        route(path, RerankRequest, RerankResponse, handlers.rerank)
    for path in SCORE_PATHS:
        route(path, ScoreRequest, ScoreResponse, handlers.score)
    return handlers
