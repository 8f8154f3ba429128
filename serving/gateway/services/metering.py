"""Metering: every admitted request gets a ledger row, metrics, spans and a trace.

The gateway's request path, as far as metering sees it::

    authenticate -> validate -> tokenize -> context check
      -> Metering.shed()         a flex request over the load threshold (429 -> a "shed" row)
      -> Metering.admit()        rate limits (429 -> a "rate_limited" row), row opened ("running")
      -> input policy            a rejection completes the row ("error")
      -> engine.submit ... RequestMeter.on_event() per engine event (timings, cache hits)
      -> RequestMeter.finish()   settles the token reservation, completes the row with
                                 tokens, timings and cost; updates the metrics; emits spans

Tokens billed are the tokens used: the prompt counts once it reached prefill
(a first token, or the prompt's log probabilities, came back), completion
tokens as generated (reasoning tokens are completion tokens: billed as output, and
counted apart in the row's ``reasoning_tokens``; an input image's soft tokens are prompt tokens,
and the images are counted apart in the trace's ``images``, priced by the table's ``per_image``). An HTTP request with several completions (prompts times
choices) is one row: its prompts counted once each, all completions summed. A request
rejected (rate limit, policy, engine) or cancelled while queued is recorded
with zero tokens; what it asked for is in its trace.

``finish`` is awaited before the response's last bytes, so a client that saw
the end of its response has its row on disk. It is idempotent: every path
(success, stop string, content filter, engine error, client disconnect) calls
it, and only the first call counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import anyio

from serving.contract.engine_client import ReplicaRetry, TokenEvent
from serving.gateway.accounts.api_keys import Principal
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.accounts.pricing import PriceTable
from serving.gateway.accounts.rate_limit import Admission, Limiter, RateLimited
from serving.gateway.services.metrics import GatewayMetrics
from serving.gateway.http.errors import SERVER_ERROR, OpenAIError
from serving.gateway.services.tracing import RequestTracer

log = logging.getLogger("xlaserve.gateway")

LEDGER_UNAVAILABLE_RETRY_AFTER_S = 30
"""``Retry-After`` of a 503 ``ledger_unavailable`` (the spool is full: the database is away)."""

LEDGER_WRITE_TIMEOUT_S = 10.0
"""How long a response waits for its ledger row to be written before it ends anyway (logged)."""


@dataclasses.dataclass
class RequestMeter:
    """Measurements of one admitted request (times are Unix seconds)."""

    metering: "Metering"
    principal: Principal
    request_id: str
    x_request_id: str
    model: str
    priority: str
    stream: bool
    arrival: float
    prompt_tokens: int
    admission: Admission | None
    service_tier: str | None = None  # the tier served (service_tiers.py); None: not set by the caller
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of those and of recomputations, reloaded from the host KV tier
    disk_cached_tokens: int = 0  # of those, read from the disk KV tier first
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    replica: str | None = None  # the engine replica's URL, when a router chose one (decode side)
    prefill_replica: str | None = None  # disaggregated serving: the replica that computed the prompt
    region: str | None = None  # the region label of the replica that served it
    replica_retries: tuple[ReplicaRetry, ...] = ()  # replicas the router left before that one
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    images: int = 0  # input images (their soft tokens are in prompt_tokens)
    itls: list[float] = dataclasses.field(default_factory=list)
    events: list[dict] = dataclasses.field(default_factory=list)
    finished: bool = False
    prefilled: bool = False
    # () -> {"reasoning_tokens", "tool_calls"}: what the chat output parsed, read at the end.
    usage_details: Callable[[], dict] | None = None

    def note(self, event: str, **fields: Any) -> None:
        """Appends a timestamped event to the request's trace."""
        self.events.append({"t": time.time(), "event": event, **fields})

    def on_event(self, ev: TokenEvent) -> None:
        """Records an engine event's timing and cache information."""
        now = time.time()
        if ev.scheduled_time is not None and self.scheduled_time is None:
            self.scheduled_time = ev.scheduled_time
        self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
        self.host_cached_tokens = max(self.host_cached_tokens, ev.host_cached_tokens)
        self.disk_cached_tokens = max(self.disk_cached_tokens, ev.disk_cached_tokens)
        if ev.replica is not None:
            self.replica = ev.replica
        if ev.prefill_replica is not None:
            self.prefill_replica = ev.prefill_replica
        if ev.region is not None:
            self.region = ev.region
        if len(ev.replica_retries) > len(self.replica_retries):
            self.replica_retries = ev.replica_retries
        self.kv_transfer_bytes = max(self.kv_transfer_bytes, ev.kv_transfer_bytes)
        self.kv_transfer_seconds = max(self.kv_transfer_seconds, ev.kv_transfer_seconds)
        self.num_preemptions = max(self.num_preemptions, ev.num_preemptions)
        self.num_draft_tokens = max(self.num_draft_tokens, ev.num_draft_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, ev.num_accepted_tokens)
        if ev.token_ids or ev.prompt_logprobs is not None:
            self.prefilled = True
        if ev.token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                self.note("first_token")
            else:
                gap = (now - self.last_token_time) / len(ev.token_ids)
                self.itls.extend([gap] * len(ev.token_ids))
            self.last_token_time = now

    async def finish(self, status: str, finish_reason: str | None = None,
                     completion_tokens: int = 0, error: str | None = None,
                     cached_tokens: int | None = None) -> None:
        """Completes the request's record: ledger row, rate-limit settlement, metrics, spans.

        Args:
          status: "ok", "error" or "cancelled".
          finish_reason: "stop", "length", "content_filter", or None.
          completion_tokens: tokens generated (also for cancelled and failed requests).
          error: what went wrong, for the trace.
          cached_tokens: prompt tokens served from the prefix cache, when the
            caller summed them over several prompts (None: the largest an
            event reported).
        """
        if self.finished:
            return
        self.finished = True
        if cached_tokens is not None:
            self.cached_tokens = cached_tokens
        await self.metering._finish(self, status, finish_reason, completion_tokens, error)


def cached_by_tier(cached: int, host: int, disk: int) -> dict[str, int]:
    """{"device", "host", "disk"}: the prompt tokens each KV tier served of ``cached`` (host and
    disk pages are reloaded into the device's pages; a page read from disk went through host
    memory and counts as disk). Recomputations after a preemption may reload more than
    ``cached``: each share is clipped to it."""
    disk = min(disk, cached)
    host = min(max(host - disk, 0), cached - disk)
    return {"device": cached - host - disk, "host": host, "disk": disk}


class Metering:
    """The gateway's metering services, shared by all requests.

    Args:
      ledger: where rows go (None: not recorded, e.g. in unit tests).
      prices: the price table.
      metrics: Prometheus metrics.
      limiter: rate limits (per process, or shared through Redis).
      tracer: OpenTelemetry spans (may be disabled).
    """

    def __init__(self, ledger: Ledger | None, prices: PriceTable, metrics: GatewayMetrics,
                 limiter: Limiter, tracer: RequestTracer) -> None:
        self.ledger = ledger
        self.prices = prices
        self.metrics = metrics
        self.limiter = limiter
        self.tracer = tracer

    def admit(self, principal: Principal, request_id: str, x_request_id: str, model: str,
              priority: str, stream: bool, arrival: float, prompt_tokens: int,
              max_tokens: int, service_tier: str | None = None) -> RequestMeter:
        """Applies the rate limits and opens the request's ledger row.

        Args:
          service_tier: the tier it is served at (ledger, trace and price).

        Raises:
          OpenAIError: 503 ``ledger_unavailable`` while the ledger's spool is full
            or cannot be written (the database is away): the request is not
            admitted, so nothing is served unmetered (and no row is written).
          RateLimited: over a limit (a "rate_limited" row is recorded).
        """
        if self.ledger is not None and not self.ledger.admitting:
            self.metrics.ledger_unavailable.inc()
            raise OpenAIError("The usage ledger cannot record requests now (its database is "
                              "unreachable and the local spool is full); try again later.",
                              status_code=503, type=SERVER_ERROR, code="ledger_unavailable",
                              headers={"Retry-After": str(LEDGER_UNAVAILABLE_RETRY_AFTER_S)})
        base = dict(request_id=request_id, x_request_id=x_request_id, tenant=principal.tenant,
                    key_id=principal.key_id, model=model, priority=priority, stream=stream,
                    created_at=arrival, prompt_tokens=0, service_tier=service_tier)
        try:
            admission = self.limiter.admit(principal, prompt_tokens + max_tokens)
        except RateLimited as e:
            now = time.time()
            decision = {"scope": e.scope, "limit": e.limit, "value": e.value,
                        "retry_after_s": None if e.retry_after == float("inf") else e.retry_after,
                        "decision": "rejected"}
            if self.ledger is not None:
                self.ledger.open_row({**base, "status": "rate_limited", "finished_at": now,
                                      "e2e_s": now - arrival, "error": str(e),
                                      "trace": {"rate_limit": [decision], "events": [],
                                                "requested_prompt_tokens": prompt_tokens,
                                                "requested_max_tokens": max_tokens}})
            self.metrics.requests.labels(model, "rate_limited").inc()
            self.metrics.rate_limited.labels(model, e.scope, e.limit).inc()
            raise
        meter = RequestMeter(self, principal, request_id, x_request_id, model, priority, stream,
                             arrival, prompt_tokens, admission, service_tier=service_tier)
        meter.note("admitted", reserved_tokens=admission.reserved_tokens)
        if self.ledger is not None:
            # What is known of the request if its gateway dies before it ends (ledger_instances.py).
            self.ledger.open_row({**base, "status": "running", "trace": {
                "requested_prompt_tokens": prompt_tokens, "requested_max_tokens": max_tokens}})
        return meter

    async def admit_async(self, principal: Principal, request_id: str, x_request_id: str, model: str,
                          priority: str, stream: bool, arrival: float, prompt_tokens: int,
                          max_tokens: int, service_tier: str | None = None) -> RequestMeter:
        """:meth:`admit`, in a worker thread when the limiter waits on the network (Redis), so
        the event loop never does; same arguments, result and errors."""
        call = functools.partial(self.admit, principal, request_id, x_request_id, model, priority, stream,
                                 arrival, prompt_tokens, max_tokens, service_tier=service_tier)
        if getattr(self.limiter, "blocking", False):
            return await anyio.to_thread.run_sync(call)
        return call()

    async def headers(self, principal: Principal) -> dict[str, str]:
        """The limiter's ``x-ratelimit-*`` headers of `principal`, off the event loop when it blocks."""
        if getattr(self.limiter, "blocking", False):
            return await anyio.to_thread.run_sync(self.limiter.headers, principal)
        return self.limiter.headers(principal)

    def shed(self, principal: Principal, request_id: str, x_request_id: str, model: str,
             priority: str, stream: bool, arrival: float, prompt_tokens: int, max_tokens: int,
             service_tier: str, reason: str) -> None:
        """Records a request shed before admission (a flex request over the load
        threshold): a "shed" ledger row with no tokens and no cost, its reason in
        the trace; counted in ``xlaserve:requests_total{status="shed"}``."""
        now = time.time()
        if self.ledger is not None:
            self.ledger.open_row(dict(
                request_id=request_id, x_request_id=x_request_id, tenant=principal.tenant,
                key_id=principal.key_id, model=model, priority=priority, stream=stream, created_at=arrival,
                prompt_tokens=0, service_tier=service_tier, status="shed", finished_at=now,
                e2e_s=now - arrival, error=reason,
                trace={"service_tier": service_tier, "shed": reason, "events": [],
                       "requested_prompt_tokens": prompt_tokens, "requested_max_tokens": max_tokens}))
        self.metrics.requests.labels(model, "shed").inc()

    async def _finish(self, m: RequestMeter, status: str, finish_reason: str | None,
                      completion_tokens: int, error: str | None) -> None:
        end = time.time()
        # Prompt tokens count once the prompt reached prefill (a first token or the
        # prompt's logprobs came back); a request rejected or cancelled before that used none.
        prompt_tokens = m.prompt_tokens if m.prefilled else 0
        cached_tokens = m.cached_tokens if prompt_tokens else 0
        used = prompt_tokens + completion_tokens
        if m.admission is not None:
            if getattr(self.limiter, "blocking", False):
                await anyio.to_thread.run_sync(m.admission.settle, used)
            else:
                m.admission.settle(used)
        images = m.images if prompt_tokens else 0
        cost = self.prices.cost(m.model, prompt_tokens, cached_tokens, completion_tokens, m.priority,
                                m.service_tier, images=images)
        queue_time = None if m.scheduled_time is None else max(0.0, m.scheduled_time - m.arrival)
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival
        details = {}
        if m.usage_details is not None:
            try:
                details = m.usage_details()
            except Exception:  # the row is written regardless
                log.exception("usage details of %s failed", m.request_id)
        reasoning_tokens = int(details.get("reasoning_tokens", 0))
        tool_calls = int(details.get("tool_calls", 0))
        m.note("finished", status=status, finish_reason=finish_reason)
        prefix_cache = "hit" if cached_tokens else "miss"
        trace = {
            "rate_limit": [] if m.admission is None else [
                {**d, "decision": "admitted"} for d in m.admission.decisions],
            "reserved_tokens": None if m.admission is None else m.admission.reserved_tokens,
            "settled_tokens": used,
            "service_tier": m.service_tier,
            "requested_prompt_tokens": m.prompt_tokens,
            "prefix_cache": prefix_cache,
            "host_cached_tokens": m.host_cached_tokens,
            "disk_cached_tokens": m.disk_cached_tokens,
            # which tier served cached_tokens: the device prefix cache, host memory, disk
            "cached_tokens_by_tier": cached_by_tier(cached_tokens, m.host_cached_tokens, m.disk_cached_tokens),
            "reasoning_tokens": reasoning_tokens,
            "tool_calls": tool_calls,
            "replica": m.replica,
            "prefill_replica": m.prefill_replica,
            "decode_replica": m.replica if m.prefill_replica is not None else None,
            "region": m.region,
            "replica_retries": [dataclasses.asdict(h) for h in m.replica_retries],
            "cost_usd": cost,
            "images": images,
            "kv_transfer_bytes": m.kv_transfer_bytes,
            "kv_transfer_seconds": m.kv_transfer_seconds,
            "num_preemptions": m.num_preemptions,
            "speculative": {"draft_tokens": m.num_draft_tokens, "accepted_tokens": m.num_accepted_tokens},
            "scheduled_at": m.scheduled_time,
            "errors": [error] if error else [],
            "events": m.events,
        }
        values = dict(
            status=status, finish_reason=finish_reason, error=error, finished_at=end,
            first_token_at=m.first_token_time, prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens, completion_tokens=completion_tokens, reasoning_tokens=reasoning_tokens,
            tool_calls=tool_calls, queue_time_s=queue_time, ttft_s=ttft,
            itl_mean_s=sum(m.itls) / len(m.itls) if m.itls else None,
            itl_max_s=max(m.itls) if m.itls else None, e2e_s=end - m.arrival, cost_usd=cost,
            trace=trace)
        self.metrics.observe_request(m.model, status, finish_reason, prompt_tokens, cached_tokens,
                                     completion_tokens, cost, queue_time, ttft, m.itls, end - m.arrival)
        try:
            self.tracer.emit(m.arrival, m.scheduled_time, m.first_token_time, end, {
                "xlaserve.request_id": m.request_id, "xlaserve.x_request_id": m.x_request_id,
                "xlaserve.model": m.model, "xlaserve.tenant": m.principal.tenant,
                "xlaserve.status": status, "xlaserve.finish_reason": finish_reason,
                "xlaserve.service_tier": m.service_tier,
                "xlaserve.replica": m.replica,
                "xlaserve.prefill_replica": m.prefill_replica,
                "xlaserve.region": m.region,
                "xlaserve.replica_retries": len(m.replica_retries),
                "xlaserve.replica_retries.replicas": [h.replica for h in m.replica_retries] or None,
                "xlaserve.replica_retries.reasons": [h.reason for h in m.replica_retries] or None,
                "xlaserve.cost_usd": cost,
                "xlaserve.images": images or None,
                "xlaserve.kv_transfer_bytes": m.kv_transfer_bytes or None,
                "gen_ai.usage.input_tokens": prompt_tokens,
                "gen_ai.usage.output_tokens": completion_tokens,
                "gen_ai.usage.reasoning_tokens": reasoning_tokens or None,
                "xlaserve.spec_decode.draft_tokens": m.num_draft_tokens or None,
                "xlaserve.spec_decode.accepted_tokens": m.num_accepted_tokens if m.num_draft_tokens else None})
        except Exception:
            log.exception("emitting spans failed")
        if self.ledger is None:
            return
        fut = self.ledger.close_row(m.request_id, values)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), LEDGER_WRITE_TIMEOUT_S)
        except Exception as e:  # the response still ends; the row is written late or logged
            log.error("ledger row of %s not confirmed: %r", m.request_id, e)
