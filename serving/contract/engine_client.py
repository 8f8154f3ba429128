"""The one narrow interface between the gateway and an engine.

The gateway (HTTP, auth, detokenization, stop strings) talks to an engine only
through :class:`EngineClient`: submit a tokenized request, receive an async
stream of :class:`TokenEvent`, cancel by id. The in-process engine loop implements it;
so does the router over remote replicas (``serving.routing.router``, each
replica an engine loop behind the gRPC engine service, ``serving/rpc/``). Nothing here imports JAX.

Token-level contract (as in vLLM v1's EngineCore / OutputProcessor split):
the engine deals in token ids only. Text (detokenization, stop strings) is the
caller's business; a caller that sees a stop string calls :meth:`cancel`.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Mapping, Protocol, Sequence

MAX_LOGPROBS = 20
"""The most alternatives per position ``logprobs`` / ``prompt_logprobs`` may ask for."""

MAX_LOGIT_BIAS = 300
"""The most token ids one request's ``logit_bias`` may name (OpenAI's limit)."""

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced on device with a token bitmask.

    Attributes:
      kind: one of :data:`STRUCTURED_KINDS`.
      value: for "json_schema" the schema as JSON text; for "json_object" "";
        for "regex" the pattern; for "choice" a JSON list of the allowed
        strings; for "grammar" a grammar text (llguidance's Lark dialect).
      after_token_id: None: the constraint holds from the first generated
        token; else it starts after this token is generated (a reasoning
        model's think-end token: the thinking itself is free).
    """

    kind: str
    value: str = ""
    after_token_id: int | None = None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, applied on device per slot.

    Order on device (vLLM's): logits (float32) -> logit_bias -> min_tokens
    (stop ids masked) -> repetition, frequency and presence penalties ->
    structured-output mask -> temperature -> top_k -> top_p -> min_p -> sample.
    Log probabilities are of the raw logits (before any of these), the same
    logits that sample.

    Attributes:
      max_tokens: the most new tokens to generate (>= 1; 0 only with
        ``prompt_logprobs``: score the prompt, generate nothing).
      temperature: 0.0 means greedy (argmax); otherwise logits are divided by it.
      top_k: keep the k most likely tokens; 0 disables.
      top_p: nucleus sampling mass in (0, 1]; 1.0 disables.
      min_p: drop tokens whose probability is below min_p times the most
        likely one's (vLLM's extension); 0.0 disables.
      seed: seeds the request's random stream. The stream is keyed by
        (seed, position), so a sample never depends on batch neighbours.
        None lets the engine pick one.
      stop_token_ids: generation finishes (reason "stop") after emitting any of
        these; the token is reported but is not part of the returned text.
      ignore_eos: generate exactly max_tokens tokens.
      presence_penalty: OpenAI's: subtracted once from the logit of every token
        generated so far (-2..2).
      frequency_penalty: OpenAI's: subtracted from a token's logit once per time
        it was generated so far (-2..2).
      repetition_penalty: vLLM's (CTRL's): a token seen in the prompt or the
        output has its logit divided by it when positive, multiplied when
        negative; 1.0 disables.
      logit_bias: (token id, bias) pairs added to the logits, at most
        :data:`MAX_LOGIT_BIAS`.
      min_tokens: ``stop_token_ids`` (EOS included) cannot be generated before
        this many tokens.
      logprobs: None: off. k in 0..MAX_LOGPROBS: every generated token comes
        with its log probability and the k most likely alternatives
        (``TokenEvent.logprobs``).
      prompt_logprobs: None: off. k in 0..MAX_LOGPROBS: the log probability of
        every prompt token after the first, with the k most likely
        alternatives, on the first event (``TokenEvent.prompt_logprobs``).
        The prompt is computed in full (no prefix-cache hit).
      structured_output: constrain the output (None: free text).
      num_speculative_tokens: speculative decoding's drafts for this request (vLLM-style
        per-request cap): None, the server's K; 0, none (it decodes plainly: e.g. seeded
        temperature output exactly as without speculation); n, at most n per step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    num_speculative_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class KvTransferParams:
    """Where a prompt's KV pages wait on a prefill replica (``serving.replica.kv_connector``).

    A prefill replica's final event carries them; the router passes them (with
    ``source_url`` filled in) to the decode replica's request, which pulls the
    pages before it computes the rest of the prompt.

    Attributes:
      transfer_id: names the offer on the prefill side.
      transport: "jax" (``jax.experimental.transfer``) or "grpc" (host staging).
      transfer_address: jax: the prefill replica's transfer server (host:port).
      source_url: the prefill replica's engine service (``grpc://host:port``).
      num_tokens: prompt tokens in the offered pages (whole pages: the decode side
        computes the partial last page and the last prompt token itself).
      chunk_pages: pages per chunk.
      page_shape: (layers, kv_heads, page_size, head_dim) of one page.
      dtype: the KV storage dtype's name (pages are copied bit for bit).
      kv_format: "" for unquantized pages, "int8" or "fp8" for quantized ones, whose chunks
        carry their scale pages (float32); a decode replica of another format refuses them.
      page_hashes: the offered pages' chained hashes (``kv_cache_manager.page_hash``).
      expires_at: wall-clock seconds when the prefill side frees the pages.
    """

    transfer_id: str
    transport: str
    num_tokens: int
    chunk_pages: int
    page_shape: tuple[int, ...]
    dtype: str
    page_hashes: tuple[bytes, ...] = ()
    transfer_address: str = ""
    source_url: str = ""
    expires_at: float = 0.0
    kv_format: str = ""


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """What the gateway needs to know of an engine's vision tower to build image prompts.

    Attributes:
      image_size: the side S of the [3, S, S] pixels it takes.
      tokens_per_image: soft tokens per image (the placeholder count).
      image_token_id, boi_token_id, eoi_token_id: the placeholder, start-of-image and
        end-of-image token ids.
    """

    image_size: int
    tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed for the model's vision tower.

    Attributes:
      start: position of its first soft token in ``prompt_ids`` (the first of its
        ``num_tokens`` image placeholder ids).
      num_tokens: its soft tokens (the model's ``mm_tokens_per_image``).
      digest: hex SHA-256 of ``pixels`` (``serving.gateway.media.image_processing.pixel_digest``):
        the encoder-output cache's key, and hashed into every prefix-cache page that
        covers (or follows) its tokens, so two different images never share pages.
      pixels: [3, S, S] float32 numpy array (S = the tower's image size), in [-1, 1].
    """

    start: int
    num_tokens: int
    digest: str
    pixels: object

    @property
    def end(self) -> int:
        """The position after its last soft token."""
        return self.start + self.num_tokens


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """A tokenized generation request.

    Attributes:
      request_id: unique per engine; used by :meth:`EngineClient.cancel`.
      prompt_ids: prompt token ids, BOS included where the model expects it.
      sampling: see :class:`SamplingParams`.
      arrival_time: wall-clock seconds (time.time()) when the gateway received it.
      priority: the scheduling class: "priority" runs first and may preempt default
        and flex work; "interactive" (the default; also "default") may preempt flex
        work; "batch" (also "flex") is admitted only when nothing else waits, is
        preempted first, and is promoted to default once starved (the engine's
        starvation guard).
      cache_salt: scopes prefix-cache sharing: requests share cached pages only
        with requests of the same salt. Opaque to the engine (the gateway
        derives it from the tenant and the request's own ``cache_salt``).
      parent_id: one of ``n`` choices: the id of the choice submitted first
        with the same prompt (and salt). The engine computes that prompt once
        and the choices share its KV pages (the last, partial page copied).
        If the parent is unknown or already gone the prompt is computed as usual.
      kv_produce: a prefill replica's request (disaggregated serving): when it
        finishes, its prompt's full pages are kept and offered for a decode
        replica to pull; the final event's ``kv_transfer`` says where.
      kv_transfer: a decode replica's request: the pages to pull before the rest
        of the prompt is computed.
      images: the prompt's images in prompt order (Gemma 3 vision), their spans disjoint
        and inside the prompt; () for text. An engine without a vision tower refuses them.
      lora_name: the LoRA adapter that serves it (one the engine loaded); None: the base model.
    """

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: str = "interactive"
    cache_salt: str | None = None
    parent_id: str | None = None
    kv_produce: bool = False
    kv_transfer: KvTransferParams | None = None
    images: tuple[ImageInput, ...] = ()
    lora_name: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One position's log probabilities (float32 log-softmax of the raw logits).

    Attributes:
      token_id: the token at this position (sampled, or the prompt's).
      logprob: its log probability.
      top: the k most likely (token id, logprob) pairs, most likely first
        (k as the request asked; may include ``token_id``).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class ReplicaRetry:
    """One hop a router took away from a replica before the one that served the request.

    Attributes:
      replica: the replica it left (its URL).
      region: that replica's region label ("" when it has none).
      reason: why: "unavailable" (its stream failed before any event) or
        "overloaded" (it refused the request: its queue was full).
      error: what the replica or the transport said.
    """

    replica: str
    region: str
    reason: str
    error: str = ""


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """New tokens for one request, in order.

    Attributes:
      request_id: the request these tokens belong to.
      token_ids: new token ids since the previous event (may be empty on the
        final event of a cancelled or failed request).
      finish_reason: None while running; "stop" (a stop token), "length"
        (max_tokens reached), "cancelled", or "error" on the last event.
      prompt_tokens: prompt length in tokens.
      cached_tokens: prompt tokens served from the prefix cache (host tier included).
      host_cached_tokens: tokens reloaded from the host KV tier instead of computed
        (``serving.core.kv.host_kv_cache``), over all its admissions (a preempted request's too).
      disk_cached_tokens: of those, tokens whose pages were first read from the disk KV tier
        (``serving.core.kv.disk_kv_store``); the device prefix cache served
        ``cached_tokens - host_cached_tokens``.
      completion_tokens: tokens generated so far, including these.
      first_token_time: wall-clock seconds of the first generated token, or None.
      scheduled_time: wall-clock seconds when the request was first scheduled
        (its first prefill step), or None while it waits.
      num_preemptions: times the request was preempted (and recomputed).
      error: a human-readable message when finish_reason == "error", or when
        the engine itself cancelled the request ("cancelled", e.g. its
        consumer stopped reading).
      logprobs: with ``sampling.logprobs``, one entry per ``token_ids`` entry.
      prompt_logprobs: with ``sampling.prompt_logprobs``, on the first event
        that has any token (or the final one): one entry per prompt token, None
        for the first (nothing precedes it).
      num_draft_tokens: speculative decoding: draft tokens verified for the request so far.
      num_accepted_tokens: of those, accepted (each saved a decode step).
      replica: the engine replica that produced it (its URL), when a router
        chose one (``serving.routing.router``); None in process. Disaggregated:
        the decode replica.
      prefill_replica: disaggregated serving: the replica that computed the prompt.
      region: the region label of ``replica`` (None: in process, or no label).
      replica_retries: the replicas the router tried first and left, in order
        (:class:`ReplicaRetry`); () when the first one served it.
      kv_transfer: a ``kv_produce`` request's final event: its offered pages.
      kv_transfer_bytes: bytes of KV pages the decode side pulled for it.
      kv_transfer_seconds: seconds from the start of the pull to its pages in place.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    completion_tokens: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    replica: str | None = None
    prefill_replica: str | None = None
    kv_transfer: KvTransferParams | None = None
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    region: str | None = None
    replica_retries: tuple[ReplicaRetry, ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load, for metrics.

    Attributes:
      num_running: requests holding a slot.
      num_waiting: requests waiting for admission.
      waiting_prompt_tokens: prompt tokens of those waiting requests.
      kv_cache_usage: fraction of KV-cache pages in use, 0..1.
      kv_pages_used: KV-cache pages held by requests.
      kv_pages_total: KV-cache pages that can be held (the pool less the null page).
      prefix_cache_queries: prompt tokens looked up in the prefix cache (lifetime).
      prefix_cache_hits: prompt tokens served from it (lifetime).
      num_preemptions: preemptions so far (lifetime).
      spec_verify_rows: speculative decoding: verify-step rows that had drafts (lifetime).
      spec_draft_tokens: draft tokens they verified (lifetime).
      spec_accepted_tokens: draft tokens accepted (lifetime); a row emits its accepted
        drafts plus one, so tokens per step = 1 + accepted / verify rows.
      spec_drafted_per_position, spec_accepted_per_position: per draft position j (0 the
        first draft of a row), the rows that verified a draft there and the rows that
        accepted it (lifetime).
      spec_num_tokens_now: the most drafts a request gets a step at the present load (K,
        or 0 while more than ``--speculative-max-batch`` requests run; 0 without speculation).
      host_kv_hits, host_kv_stores, host_kv_evictions: the host KV tier's pages reloaded,
        stored and dropped (lifetime; all 0 without one).
      host_kv_usage_bytes, host_kv_capacity_bytes: its bytes held and its bound.
      disk_kv_hits, disk_kv_stores, disk_kv_evictions: the disk KV tier's pages read back,
        written and removed by its bound (lifetime; all 0 without one).
      disk_kv_usage_bytes, disk_kv_capacity_bytes: its files' bytes and its bound.
      disk_kv_bytes_read, disk_kv_bytes_written: file bytes (lifetime).
      disk_kv_read_seconds, disk_kv_reads: seconds spent reading pages, and the pages read.
      disk_kv_corrupt_files, disk_kv_foreign_files: files ignored: torn or corrupt (removed),
        of another model or KV format (left alone).
      disk_kv_dropped_pages: pages not written (the disk full, or another write error).
      lora_running: the LoRA adapters of requests in the running batch (sorted, unique).
      lora_waiting: the LoRA adapters of requests waiting (for a slot or an adapter slot).
      max_loras: the most adapters resident on the device at once (0: no LoRA serving).
      turn_profile: where the engine loop's time went (lifetime): ``seconds.<part>``,
        ``turns.<kind>``, ``prefill_tokens``, ``decode_rows``
        (``serving.runtime.turn_profile``); empty for an engine that keeps none.
    """

    num_running: int = 0
    num_waiting: int = 0
    waiting_prompt_tokens: int = 0
    kv_cache_usage: float = 0.0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_verify_rows: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_per_position: tuple[int, ...] = ()
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_num_tokens_now: int = 0
    host_kv_hits: int = 0
    host_kv_stores: int = 0
    host_kv_evictions: int = 0
    host_kv_usage_bytes: int = 0
    host_kv_capacity_bytes: int = 0
    disk_kv_hits: int = 0
    disk_kv_stores: int = 0
    disk_kv_evictions: int = 0
    disk_kv_usage_bytes: int = 0
    disk_kv_capacity_bytes: int = 0
    disk_kv_bytes_read: int = 0
    disk_kv_bytes_written: int = 0
    disk_kv_read_seconds: float = 0.0
    disk_kv_reads: int = 0
    disk_kv_corrupt_files: int = 0
    disk_kv_foreign_files: int = 0
    disk_kv_dropped_pages: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0
    turn_profile: Mapping[str, float] = dataclasses.field(default_factory=dict)


class EngineOverloadedError(RuntimeError):
    """The engine cannot admit more requests now; the caller should retry later."""


class RequestRejectedError(ValueError):
    """The request can never be served as asked (e.g. longer than the KV cache)."""


class LoraInUseError(RuntimeError):
    """A LoRA adapter that running or waiting requests use cannot be unloaded now."""


class EngineClient(Protocol):
    """What a gateway needs from an engine (in-process or over gRPC)."""

    @property
    def max_model_len(self) -> int:
        """Context window in tokens (prompt + generated)."""

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens (prompt + generated) one request can hold in the KV
        cache when it runs alone; :meth:`submit` rejects a request whose prompt
        plus ``max_tokens`` exceeds it (or the context window)."""

    def submit(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """Start generating; returns the request's event stream.

        Raises:
          EngineOverloadedError: the waiting queue is full.
          RequestRejectedError: the request can never fit.
        """

    async def cancel(self, request_id: str) -> None:
        """Stop a request within one step and free its pages. Unknown ids are ignored."""

    def is_ready(self) -> bool:
        """True once weights are loaded and step functions compiled."""

    def stats(self) -> EngineStats:
        """The current load (cheap; called at every metrics scrape)."""
