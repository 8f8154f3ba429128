"""OpenAI completions and chat completions on top of an :class:`EngineClient`.

Per request: validate -> check each prompt's length (``max_prompt_chars``) ->
tokenize (``encode(prompt, add_bos=True)`` or the chat template, in a worker
thread: ``prompts.py``) -> check the context window (per prompt) -> the
engine's settings (``sampling_params.py``) -> one engine request per (prompt,
choice) (``choices.py``) -> rate limits and metering (once) -> input policy ->
submit -> text from the output pipelines
(:class:`~serving.gateway.openai.generation.MeteredGeneration` over
:class:`~serving.output.output_processor.TextGeneration`: stop tokens, stop strings,
the output policy, cancel on stop), log probabilities (``choice_logprobs.py``) ->
JSON or SSE. A client that disconnects, while streaming or not, cancels its
engine requests.

The first engine event is awaited before the response starts, so admission
errors (overloaded: 503, rejected: 400) get a proper HTTP status even when
streaming. Errors after streaming has started are sent as an SSE ``data:
{"error": ...}`` event followed by ``data: [DONE]``. A streaming client that
stops reading is cut off after ``stream_write_timeout`` seconds: its engine
request is cancelled and it is metered as cancelled ("client not reading").
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from email.message import Message
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import anyio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.contract.engine_client import StructuredOutput
from serving.gateway.accounts.api_keys import ANONYMOUS, Principal
from serving.gateway.accounts.rate_limit import RateLimited
from serving.gateway.http.disconnect import until_disconnect
from serving.gateway.http.errors import (
    ClientDisconnected,
    OpenAIError,
    context_length_exceeded,
    model_not_allowed,
    model_not_found,
    no_room_for_completion,
    rate_limited,
)
from serving.gateway.http.limits import GatewayLimits
from serving.gateway.http.request_scope import RATE_LIMIT_HEADERS_SCOPE_KEY, request_id_of
from serving.gateway.media.image_input import check_image_count, fetch_tls_context
from serving.gateway.media.decode_workers import DecodeWorkers
from serving.gateway.media.image_prompt import expand_image_placeholders, load_images, prompt_images
from serving.gateway.media.pixel_budget import PixelBudget
from serving.gateway.media.tenant_decodes import TenantDecodeLanes
from serving.gateway.openai.chat_plan import ChatPlan, chat_plan
from serving.gateway.openai.chat_run import ChatRun
from serving.gateway.openai.choice_logprobs import ChatChoiceRenderer, CompletionChoiceRenderer
from serving.gateway.openai.choice_stream import ChoiceStreams
from serving.gateway.openai.choices import Slot, fan_out, pick_best
from serving.gateway.openai.generation import MeteredGeneration
from serving.gateway.openai.prompts import PromptWorkers
from serving.gateway.openai.sampling_params import sampling_params
from serving.gateway.openai.served_model import ServedModel, adapter_model
from serving.gateway.openai.token_text import token_texts
from serving.gateway.schema.protocol import ChatCompletionRequest, CompletionRequest
from serving.gateway.schema.response_models import (
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from serving.gateway.schema.structured_request import check_structured_output
from serving.gateway.services.gateway_services import GatewayServices
from serving.gateway.services.policy import PolicyViolation
from serving.gateway.services.service_tiers import ENGINE_PRIORITY, flex_shed, served_tier

logger = logging.getLogger("xlaserve.gateway")

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""


# --------------------------------------------------------------- helpers


async def read_json(request: Request) -> Any:
    """The parsed JSON body of a request that says it is JSON.

    Raises:
      OpenAIError: 415 ``unsupported_media_type`` unless the Content-Type is
        ``application/json`` (in UTF-8); 400 ``invalid_json`` for a malformed
        or non-UTF-8 body, a constant JSON does not have (NaN, Infinity), an
        integer beyond Python's digit limit or nesting too deep to parse.
    """
    require_json_content_type(request.headers.get("content-type"))
    body = await request.body()
    try:
        return json.loads(body, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        detail = f"{e.msg} at line {e.lineno} column {e.colno}"
    except UnicodeDecodeError as e:
        detail = str(e)
    except RecursionError:
        detail = "nested too deeply"
    except ValueError as e:  # NaN or Infinity; an integer beyond the digit limit
        detail = str(e).split(";")[0]
    raise OpenAIError(f"The request body is not valid JSON ({detail}).", code="invalid_json")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def require_json_content_type(content_type: str | None) -> None:
    """Accepts ``application/json`` with no charset or UTF-8 (any case).

    Requiring it keeps web pages from posting here: a browser sends a
    cross-site ``text/plain`` or form POST without asking (no CORS preflight),
    but not an ``application/json`` one.

    Raises:
      OpenAIError: 415 ``unsupported_media_type`` otherwise.
    """
    header = Message()
    header["content-type"] = content_type or ""
    charset = (header.get_content_charset() or "utf-8").lower()
    if (not content_type or header.get_content_type() != "application/json"
            or charset not in ("utf-8", "utf8")):
        raise OpenAIError(
            f"Content-Type must be 'application/json' (UTF-8); got "
            f"{repr(content_type) if content_type else 'none'}.",
            status_code=415, code="unsupported_media_type")


# --------------------------------------------------------------- serving


class OpenAIServing:
    """Request handlers for ``/v1/completions`` and ``/v1/chat/completions``.

    Args:
      models: served models by the name clients pass as ``model``.
      services: auth, metering and policies (default: open, nothing recorded).
      limits: prompt length, stream write timeout, tokenizer threads (default:
        :class:`GatewayLimits`'s defaults).
    """

    def __init__(self, models: Mapping[str, ServedModel], services: GatewayServices | None = None,
                 limits: GatewayLimits | None = None) -> None:
        self.models = dict(models)
        self.services = services or GatewayServices()
        self.limits = limits or GatewayLimits()
        self.prompts = PromptWorkers(self.limits.max_prompt_chars, self.limits.tokenizer_threads)
        # Images in threads of their own at a lower priority: bombs wait behind each other, not
        # other tenants' prompts, and yield the cores (serving/gateway/media/decode_workers.py).
        self.images = DecodeWorkers()
        # Decoded image pixels in flight, all requests together: two of the largest images allowed.
        self.pixel_budget = PixelBudget(2 * self.limits.media.max_image_pixels)
        # Each tenant's decodes in a lane of its own: its images wait behind its own, it holds
        # at most one decode thread, its pixels in flight and per second are bounded
        # (tenant_decodes.py).
        media = self.limits.media
        self.decode_lanes = TenantDecodeLanes(max_tenant_pixels=media.max_tenant_image_pixels,
                                              pixel_rate=media.tenant_image_pixel_rate,
                                              pixel_burst=2 * media.max_image_pixels)
        if self.limits.media.allowed_media_domains:  # built now, not on the event loop at the first fetch
            fetch_tls_context()
        self.streams = ChoiceStreams(self.services, self.limits)

    def follow_adapters(self) -> None:
        """Brings the LoRA adapters of models served through a router (an engine with
        ``routed_lora_names``: the adapters its replicas report) into :attr:`models`, each with
        its base as ``parent``, and drops those no replica serves any more. Models of an
        in-process engine are unchanged (the load and unload routes keep them)."""
        for base in [m for m in self.models.values() if m.lora_name is None]:
            names = getattr(base.engine, "routed_lora_names", None)
            if names is None:
                continue
            served = set(names())
            for n, m in list(self.models.items()):
                if m.lora_name is not None and m.engine is base.engine and n not in served:
                    del self.models[n]
            for n in sorted(served - self.models.keys()):
                self.models[n] = adapter_model(base, n)
                self.services.metering.prices.parents[n] = base.name

    def model(self, name: str, principal: Principal = ANONYMOUS) -> ServedModel:
        """The served model called `name`, if `principal` may use it.

        Raises:
          OpenAIError: 404 ``model_not_found``, 403 ``model_not_allowed``.
        """
        self.follow_adapters()
        served = self.models.get(name)
        if served is None:
            raise model_not_found(name)
        if not principal.may_use(name):
            raise model_not_allowed(name)
        return served

    @staticmethod
    def generative(served: ServedModel) -> ServedModel:
        """`served`, if it generates text.

        Raises:
          OpenAIError: 400 ``model_not_supported`` for an embedding or rerank model.
        """
        if served.task != "generate":
            routes = "POST /v1/embeddings" if served.task == "embed" else "POST /v1/rerank and /v1/score"
            raise OpenAIError(f"The model `{served.name}` is an {served.task} model: it serves {routes} "
                              f"only, not completions, chat or responses.", param="model",
                              code="model_not_supported")
        return served

    # ---------------------------------------------------------- building

    @staticmethod
    def _check_context(served: ServedModel, prompt_tokens: int, max_tokens: int, where: str) -> None:
        if prompt_tokens + max_tokens > served.max_model_len:
            raise context_length_exceeded(served.max_model_len, prompt_tokens, max_tokens, where=where)

    @staticmethod
    def _response_id(request: Request, prefix: str) -> str:
        """`prefix` (separator included: "chatcmpl-", "resp_") and the request id, or a
        fresh one when the client chose the request id."""
        rid, given = request_id_of(request)
        return f"{prefix}{uuid.uuid4().hex if given else rid}"

    # -------------------------------------------------------- completions

    async def create_completion(self, request: Request, principal: Principal = ANONYMOUS) -> Response:
        """``POST /v1/completions``: one or several prompts, ``n`` / ``best_of`` choices each
        (``choices.py``), ``logprobs`` and ``echo`` (``choice_logprobs.py``).

        Raises:
          OpenAIError: 400 (bad request, context overflow, content policy),
            403 (model not allowed), 404 (unknown model), 429 (rate limit).
          pydantic.ValidationError: invalid fields (turned into 400).
          EngineOverloadedError, RequestRejectedError: from the engine.
          ClientDisconnected: the client went away.
        """
        arrival = time.time()
        req = CompletionRequest.model_validate(await read_json(request))
        served = self.generative(self.model(req.model, principal))
        need_text = bool(self.services.policies.input_policies) or req.echo
        prompt_ids, texts, echo_texts = [], [], []
        for prompt in req.prompts:
            ids, text = await self.prompts.completion(served.tokenizer, prompt, decode=need_text)
            prompt_ids.append(ids)
            texts += text
            echo_texts.append(text[0] if req.echo else None)
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        gen, slots = await self._start(request, principal, arrival, served, "cmpl-", prompt_ids, req,
                                       max_tokens, req.choices_per_prompt, "prompt", texts)
        texts_of = token_texts(served.tokenizer)
        firsts = {slot.prompt: o for o, slot in reversed(list(zip(gen.outputs, slots)))}
        renderers = [CompletionChoiceRenderer(
            o, texts_of, echo_text=echo_texts[slot.prompt], prompt_ids=prompt_ids[slot.prompt],
            logprobs=req.logprobs is not None, as_ids=req.return_tokens_as_token_ids,
            prompt_source=firsts[slot.prompt]) for o, slot in zip(gen.outputs, slots)]
        created = int(time.time())
        if req.stream:
            return self.streams.stream_response(gen, self._completion_stream(gen, req, created, renderers, slots))
        outs = await self.streams.collect(request, gen)
        if (req.best_of or 1) > req.n:
            picked = pick_best(gen.outputs, slots, req.n)
        else:
            picked = [(slot.prompt * req.n + slot.choice, k) for k, slot in enumerate(slots)]
        choices = []
        for index, k in picked:
            text, logprobs = renderers[k].piece(outs[k])
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=gen.outputs[k].finish_reason))
        body = CompletionResponse(id=gen.id, created=created, model=req.model, choices=choices,
                                  usage=gen.usage(), service_tier=gen.service_tier)
        return JSONResponse(body.model_dump(mode="json"))

    async def _start(self, request: Request, principal: Principal, arrival: float,
                     served: ServedModel, id_prefix: str, prompt_ids: list[list[int]], req,
                     max_tokens: int, per_prompt: int, param: str, texts: list[str],
                     structured_output: StructuredOutput | None = None,
                     images: tuple | Callable[[str], Awaitable[tuple]] = (),
                     ) -> tuple[MeteredGeneration, list[Slot]]:
        """Context check (per prompt), the service tier (allow-list, flex shedding),
        rate limits and metering (once, for all completions), input policy, then
        submit every (prompt, choice); returns once the engine has admitted them all.

        ``images``: the chat prompt's ``ImageInput``s, or an async callable making them,
        awaited only once the request is admitted (its images' soft tokens are in
        ``prompt_ids`` already); a failure there is metered as the request's error.

        Raises:
          OpenAIError: 400 when a prompt plus max_tokens exceeds the context
            window, a token id is outside the vocabulary, or the input policy
            rejects it, 403 for a service tier the caller may not use, 429 over a
            rate limit or for a flex request shed under load, or the engine's
            admission errors (503 overloaded, 400 rejected).
        """
        for ids in prompt_ids:
            self._check_context(served, len(ids), max_tokens, param)
        tier = served_tier(req.service_tier, req.priority, principal)
        if structured_output is None:
            structured_output = req.structured_output
        if structured_output is not None:  # an invalid schema / regex / grammar is a 400 here
            await self.prompts.run(check_structured_output, structured_output,
                                   req.structured_output_field or "tools", served.tokenizer)
        sampling = sampling_params(req, max_tokens, served.tokenizer, structured_output)
        response_id = self._response_id(request, id_prefix)
        engine_requests, slots = fan_out(
            response_id, prompt_ids, sampling, per_prompt,
            priority="batch" if req.priority == "batch" else ENGINE_PRIORITY[tier],
            cache_salt=self.services.cache_scopes.salt(principal.tenant, req.cache_salt),
            images=() if callable(images) else images, lora_name=served.lora_name)
        rid, _ = request_id_of(request)
        prompt_tokens = sum(len(ids) for ids in prompt_ids)
        logger.info("request %s (X-Request-ID %s): model=%s prompts=%d choices=%d prompt_tokens=%d "
                    "max_tokens=%d service_tier=%s", response_id, rid, served.name, len(prompt_ids), per_prompt,
                    prompt_tokens, max_tokens, tier)
        flex = self.services.flex_admission
        overload = flex.overload(served.engine.stats()) if tier == "flex" and req.priority != "batch" else None
        if overload is not None:
            logger.info("request %s shed: %s", response_id, overload)
            self.services.metering.shed(principal, response_id, rid, served.name, req.priority, bool(req.stream),
                                        arrival, prompt_tokens, max_tokens * len(engine_requests), tier, overload)
            raise flex_shed(overload, flex.retry_after_s)
        try:
            meter = await self.services.metering.admit_async(
                principal, response_id, rid, served.name, req.priority, bool(req.stream), arrival,
                prompt_tokens, max_tokens * len(engine_requests), service_tier=tier)
        except RateLimited as e:
            logger.info("request %s rate limited: %s %s limit", response_id, e.scope, e.limit)
            raise rate_limited(e) from None
        request.scope[RATE_LIMIT_HEADERS_SCOPE_KEY] = meter.admission.headers
        if callable(images):
            try:
                images = await until_disconnect(request, images(principal.tenant))
            except BaseException as e:
                with anyio.CancelScope(shield=True):
                    gone = isinstance(e, (ClientDisconnected, asyncio.CancelledError))
                    await meter.finish("cancelled" if gone else "error",
                                       error=None if gone else getattr(e, "message", repr(e)))
                raise
            engine_requests, slots = fan_out(
                response_id, prompt_ids, sampling, per_prompt,
                priority="batch" if req.priority == "batch" else ENGINE_PRIORITY[tier],
                cache_salt=self.services.cache_scopes.salt(principal.tenant, req.cache_salt), images=images,
                lora_name=served.lora_name)
        if images:  # in prompt_tokens already (their soft tokens); counted apart in the trace and ledger
            meter.note("images", count=len(images), soft_tokens=sum(im.num_tokens for im in images))
            meter.images = len(images)
        gen = MeteredGeneration(served, engine_requests, req.stop_strings, meter,
                                self.services.policies.output_filter, response_id=response_id,
                                service_tier=tier)
        if self.services.log_text:
            logger.info("request %s prompt: %r", gen.id, texts or prompt_ids)
        try:
            self.services.policies.check_input(texts)
            await until_disconnect(request, gen.start())
        except PolicyViolation as e:
            meter.note("input_policy", policy=e.policy)
            await gen.settle("error", f"content_policy_violation ({e.policy})")
            raise OpenAIError(str(e), code="content_policy_violation", param=param) from None
        except BaseException as e:
            await gen.settle_exception(e)
            raise
        return gen, slots

    def _completion_stream(self, gen: MeteredGeneration, req: CompletionRequest, created: int,
                           renderers: list[CompletionChoiceRenderer], slots: list[Slot],
                           ) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(id=gen.id, created=created, model=req.model, usage=usage,
                                      choices=choices, service_tier=gen.service_tier)

        def piece(k: int, text: str, finish: str | None = None) -> list[CompletionResponse]:
            text, logprobs = renderers[k].piece(text)
            index = slots[k].prompt * req.n + slots[k].choice
            return [chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=finish)])]

        pieces = self.streams.choice_pieces(
            gen, opening=None, delta=piece,
            closing=lambda k, reason=None: piece(k, "", reason or gen.outputs[k].finish_reason))
        return self.streams.sse_body(pieces, req.include_usage, usage=lambda: chunk([], usage=gen.usage()))

    # --------------------------------------------------------------- chat

    async def create_chat_completion(self, request: Request, principal: Principal = ANONYMOUS) -> Response:
        """``POST /v1/chat/completions``: ``n`` choices, ``logprobs`` / ``top_logprobs``,
        tools and reasoning (see :meth:`start_chat`).

        Raises:
          Same as :meth:`start_chat`.
        """
        arrival = time.time()
        req = ChatCompletionRequest.model_validate(await read_json(request))
        run = await self.start_chat(request, principal, req, arrival=arrival)
        if req.stream:
            return self.streams.stream_response(run.gen, self.streams.sse_body(
                run.chunks(), req.include_usage, usage=run.usage_chunk))
        body = await run.response(request)
        return JSONResponse(body.model_dump(mode="json"))

    async def start_chat(self, request: Request, principal: Principal, req: ChatCompletionRequest, *,
                         arrival: float, id_prefix: str = "chatcmpl-") -> ChatRun:
        """Renders the messages (and tools) with the chat template, checks the
        context, meters and submits the choices; returns once the engine
        admitted them.

        ``max_tokens`` defaults to the most the request can have: what the
        messages leave of the context window and of the KV cache
        (``min(max_model_len, kv_capacity_tokens) - prompt_tokens``), capped
        by the operator's ``default_chat_max_tokens`` when set.

        Args:
          request: the HTTP request (its id, its scope for rate-limit headers,
            its disconnect).
          req: the validated request.
          arrival: when the request arrived (Unix seconds).
          id_prefix: the response id's prefix, separator included.

        Raises:
          Same as :meth:`create_completion`; 400 also for messages the chat
          template rejects, and (``context_length_exceeded``) for messages
          that leave no room for a completion when ``max_tokens`` is not given.
        """
        served = self.generative(self.model(req.model, principal))
        plan, prompt_ids, images = await self.chat_prompt(req, served)
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            max_tokens = served.max_request_tokens - len(prompt_ids)
            if max_tokens < 1:
                raise no_room_for_completion(served.max_model_len, served.kv_capacity_tokens,
                                             len(prompt_ids))
            if served.default_chat_max_tokens is not None:
                max_tokens = min(max_tokens, served.default_chat_max_tokens)
        texts = [m.content for m in req.messages if isinstance(m.content, str)]
        plan.bind_prompt(prompt_ids)
        gen, _ = await self._start(request, principal, arrival, served, id_prefix, [prompt_ids],
                                   req, max_tokens, req.n, "messages", texts,
                                   structured_output=plan.structured_output, images=images)
        texts_of = token_texts(served.tokenizer)
        renderers = [ChatChoiceRenderer(o, texts_of, top_logprobs=req.top_logprobs or 0,
                                        as_ids=req.return_tokens_as_token_ids) if req.logprobs else None
                     for o in gen.outputs]
        return ChatRun(self.streams, gen, req, int(time.time()), [plan.output(o) for o in gen.outputs], renderers)

    async def chat_prompt(self, req: ChatCompletionRequest, served: ServedModel,
                          ) -> tuple[ChatPlan, list[int], tuple | Callable[[str], Awaitable[tuple]]]:
        """The plan (tools, constraint, parsers), the prompt's token ids and its images of a
        chat request on `served`: what :meth:`start_chat` submits, and what
        ``/v1/messages/count_tokens`` counts. The images are ``()`` or a coroutine function of the
        caller's tenant that decodes them (``EngineRequest.images``) once the request is
        admitted, so a caller over its limits costs no decode, in that tenant's decode lane
        (``serving.gateway.media.tenant_decodes``; 429 when the lane is full); the prompt ids
        already hold their soft tokens.

        Raises:
          OpenAIError: 400 for messages the chat template rejects, images on a model
            that takes none, too many images or characters,
            and ``tool_choice`` "auto" on a model without a tool-call parser.
        """
        plan = chat_plan(req, served)
        image_parts = [(f"messages[{i}].content[{k}]", url)
                       for i, m in enumerate(req.messages) for k, url in m.image_urls]
        if image_parts:
            spec = getattr(served.engine, "vision", None)
            if spec is None:
                raise OpenAIError(f"{image_parts[0][0]}: the model {served.name!r} takes no image inputs.",
                                  param=image_parts[0][0], code="images_not_supported")
            check_image_count(len(image_parts), self.limits.media, "messages")
        try:
            prompt_ids = await self.prompts.chat(served.tokenizer, [m.to_template(i) for i, m in enumerate(req.messages)],
                                                 tools=plan.template_tools)
        except ValueError as e:
            raise OpenAIError(f"Invalid 'messages': {e}", param="messages") from None
        images = ()
        if image_parts:
            newline = await self.prompts.run(served.tokenizer.encode, "\n\n")
            prompt_ids, starts = expand_image_placeholders(prompt_ids, spec, newline, len(image_parts))

            async def images(tenant: str):  # decoded once admitted: a rate-limited caller costs no decode
                lane = functools.partial(self.decode_lanes.hold, tenant)
                loaded = await load_images(image_parts, spec, self.limits.media, self.images.run,
                                           budget=self.pixel_budget, lane=lane)
                return prompt_images(starts, loaded, spec)
        return plan, prompt_ids, images
