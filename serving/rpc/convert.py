"""The engine client's dataclasses to and from the engine service's messages.

``serving.contract.engine_client`` (``EngineRequest``, ``SamplingParams``,
``TokenEvent``, ``EngineStats``) on one side, ``serving/rpc/engine.proto`` on
the other; each function is one direction of one message. Floats travel as
float64, so what arrives equals what was sent (log probabilities as the
engine reported them, sampling settings as the gateway parsed them).

No JAX here: the gateway uses this module.
"""

from __future__ import annotations

from serving.contract.engine_client import (
    EngineRequest,
    EngineStats,
    KvTransferParams,
    SamplingParams,
    StructuredOutput,
    TokenEvent,
    TokenLogprobs,
)
from serving.rpc import engine_pb2 as pb


def sampling_to_proto(s: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in s.logit_bias], min_tokens=s.min_tokens)
    if s.seed is not None:
        m.seed = s.seed
    if s.logprobs is not None:
        m.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        m.prompt_logprobs = s.prompt_logprobs
    if s.num_speculative_tokens is not None:
        m.num_speculative_tokens = s.num_speculative_tokens
    if s.structured_output is not None:
        so = s.structured_output
        m.structured_output.CopyFrom(pb.StructuredOutput(kind=so.kind, value=so.value,
                                                         after_token_id=so.after_token_id))
    return m


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=m.temperature, top_k=m.top_k, top_p=m.top_p, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None, stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos, presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty,
        logit_bias=tuple((b.token_id, b.bias) for b in m.logit_bias), min_tokens=m.min_tokens,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        num_speculative_tokens=m.num_speculative_tokens if m.HasField("num_speculative_tokens") else None,
        structured_output=(StructuredOutput(
            m.structured_output.kind, m.structured_output.value,
            m.structured_output.after_token_id if m.structured_output.HasField("after_token_id") else None)
            if m.HasField("structured_output") else None))


def kv_transfer_to_proto(t: KvTransferParams) -> pb.KvTransfer:
    return pb.KvTransfer(transfer_id=t.transfer_id, transport=t.transport, transfer_address=t.transfer_address,
                         source_url=t.source_url, num_tokens=t.num_tokens, chunk_pages=t.chunk_pages,
                         page_shape=list(t.page_shape), dtype=t.dtype, page_hashes=list(t.page_hashes),
                         expires_at=t.expires_at, kv_format=t.kv_format)


def kv_transfer_from_proto(m: pb.KvTransfer) -> KvTransferParams:
    return KvTransferParams(transfer_id=m.transfer_id, transport=m.transport, num_tokens=m.num_tokens,
                            chunk_pages=m.chunk_pages, page_shape=tuple(m.page_shape), dtype=m.dtype,
                            page_hashes=tuple(m.page_hashes), transfer_address=m.transfer_address,
                            source_url=m.source_url, expires_at=m.expires_at, kv_format=m.kv_format)


def request_to_proto(r: EngineRequest) -> pb.GenerateRequest:
    """Raises RequestRejectedError: a request with images (the replica protocol carries none)."""
    if r.images:
        from serving.contract.engine_client import RequestRejectedError

        raise RequestRejectedError("image inputs are not sent to remote engine replicas")
    m = pb.GenerateRequest(request_id=r.request_id, prompt_ids=list(r.prompt_ids),
                           sampling=sampling_to_proto(r.sampling), arrival_time=r.arrival_time,
                           priority=r.priority, kv_produce=r.kv_produce)
    if r.kv_transfer is not None:
        m.kv_transfer.CopyFrom(kv_transfer_to_proto(r.kv_transfer))
    if r.cache_salt is not None:
        m.cache_salt = r.cache_salt
    if r.parent_id is not None:
        m.parent_id = r.parent_id
    if r.lora_name is not None:
        m.lora_name = r.lora_name
    return m


def request_from_proto(m: pb.GenerateRequest) -> EngineRequest:
    return EngineRequest(
        request_id=m.request_id, prompt_ids=tuple(m.prompt_ids), sampling=sampling_from_proto(m.sampling),
        arrival_time=m.arrival_time, priority=m.priority or "interactive",
        cache_salt=m.cache_salt if m.HasField("cache_salt") else None,
        parent_id=m.parent_id if m.HasField("parent_id") else None, kv_produce=m.kv_produce,
        lora_name=m.lora_name if m.HasField("lora_name") else None,
        kv_transfer=kv_transfer_from_proto(m.kv_transfer) if m.HasField("kv_transfer") else None)


def _logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top])


def _logprobs_from_proto(m: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, tuple(zip(m.top_ids, m.top_logprobs)))


def tokens_to_proto(ev: TokenEvent) -> pb.Tokens:
    """The tokens and counts of an event (its finish reason and error go in Complete / Error)."""
    m = pb.Tokens(token_ids=ev.token_ids, prompt_tokens=ev.prompt_tokens, cached_tokens=ev.cached_tokens,
                  host_cached_tokens=ev.host_cached_tokens, disk_cached_tokens=ev.disk_cached_tokens,
                  completion_tokens=ev.completion_tokens, num_preemptions=ev.num_preemptions,
                  num_draft_tokens=ev.num_draft_tokens, num_accepted_tokens=ev.num_accepted_tokens,
                  kv_transfer_bytes=ev.kv_transfer_bytes, kv_transfer_seconds=ev.kv_transfer_seconds)
    if ev.first_token_time is not None:
        m.first_token_time = ev.first_token_time
    if ev.scheduled_time is not None:
        m.scheduled_time = ev.scheduled_time
    if ev.logprobs is not None:
        m.has_logprobs = True
        m.logprobs.extend(_logprobs_to_proto(lp) for lp in ev.logprobs)
    if ev.prompt_logprobs is not None:
        m.has_prompt_logprobs = True
        m.prompt_logprobs.extend(
            pb.PromptLogprob() if lp is None else pb.PromptLogprob(present=True, value=_logprobs_to_proto(lp))
            for lp in ev.prompt_logprobs)
    return m


def event_to_proto(ev: TokenEvent) -> pb.GenerateResponse:
    """One engine event as a stream message: Tokens while running, then Complete or Error."""
    tokens = tokens_to_proto(ev)
    if ev.finish_reason is None:
        return pb.GenerateResponse(tokens=tokens)
    if ev.finish_reason == "error":
        return pb.GenerateResponse(error=pb.Error(code=pb.Error.ENGINE_ERROR, message=ev.error or "",
                                                  last=tokens))
    complete = pb.Complete(last=tokens, finish_reason=ev.finish_reason, message=ev.error or "")
    if ev.kv_transfer is not None:
        complete.kv_transfer.CopyFrom(kv_transfer_to_proto(ev.kv_transfer))
    return pb.GenerateResponse(complete=complete)


def event_from_proto(request_id: str, m: pb.Tokens, finish_reason: str | None = None,
                     error: str | None = None, kv_transfer: pb.KvTransfer | None = None) -> TokenEvent:
    return TokenEvent(
        request_id=request_id, token_ids=tuple(m.token_ids), finish_reason=finish_reason,
        prompt_tokens=m.prompt_tokens, cached_tokens=m.cached_tokens, completion_tokens=m.completion_tokens,
        host_cached_tokens=m.host_cached_tokens, disk_cached_tokens=m.disk_cached_tokens,
        first_token_time=m.first_token_time if m.HasField("first_token_time") else None,
        scheduled_time=m.scheduled_time if m.HasField("scheduled_time") else None,
        num_preemptions=m.num_preemptions, error=error,
        logprobs=tuple(map(_logprobs_from_proto, m.logprobs)) if m.has_logprobs else None,
        prompt_logprobs=tuple(_logprobs_from_proto(p.value) if p.present else None for p in m.prompt_logprobs)
        if m.has_prompt_logprobs else None,
        num_draft_tokens=m.num_draft_tokens, num_accepted_tokens=m.num_accepted_tokens,
        kv_transfer_bytes=m.kv_transfer_bytes, kv_transfer_seconds=m.kv_transfer_seconds,
        kv_transfer=kv_transfer_from_proto(kv_transfer) if kv_transfer is not None else None)


def load_to_proto(s: EngineStats) -> pb.Load:
    return pb.Load(
        num_running=s.num_running, num_waiting=s.num_waiting, waiting_prompt_tokens=s.waiting_prompt_tokens,
        kv_pages_used=s.kv_pages_used, kv_pages_total=s.kv_pages_total,
        prefix_cache_hit_rate=s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
        prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions, **_host_kv(s))


def load_from_proto(m: pb.Load) -> EngineStats:
    return EngineStats(
        num_running=m.num_running, num_waiting=m.num_waiting, waiting_prompt_tokens=m.waiting_prompt_tokens,
        kv_cache_usage=m.kv_pages_used / m.kv_pages_total if m.kv_pages_total else 0.0,
        kv_pages_used=m.kv_pages_used, kv_pages_total=m.kv_pages_total,
        prefix_cache_queries=m.prefix_cache_queries, prefix_cache_hits=m.prefix_cache_hits,
        num_preemptions=m.num_preemptions, **_host_kv(m))


def loras_to_proto(digests: dict[str, str]) -> list[pb.LoraAdapter]:
    """{adapter name: digest} as ``LoraAdapter`` messages (sorted by name)."""
    return [pb.LoraAdapter(name=n, digest=d) for n, d in sorted(digests.items())]


def loras_from_proto(adapters) -> dict[str, str]:
    """``LoraAdapter`` messages as {adapter name: digest}."""
    return {a.name: a.digest for a in adapters}


_HOST_KV_FIELDS = ("host_kv_hits", "host_kv_stores", "host_kv_evictions", "host_kv_usage_bytes",
                   "host_kv_capacity_bytes", "disk_kv_hits", "disk_kv_stores", "disk_kv_evictions",
                   "disk_kv_usage_bytes", "disk_kv_capacity_bytes", "disk_kv_bytes_read", "disk_kv_bytes_written",
                   "disk_kv_read_seconds", "disk_kv_reads", "disk_kv_corrupt_files", "disk_kv_foreign_files",
                   "disk_kv_dropped_pages")


def _host_kv(src) -> dict[str, int]:
    """The host and disk KV tiers' counters of an ``EngineStats`` or ``pb.Load`` (same names in both)."""
    return {f: getattr(src, f) for f in _HOST_KV_FIELDS}
