"""The engine loop: runs the scheduler's plans on the engine, behind EngineClient.

One background thread owns the :class:`~serving.engine.engine.Engine` and the
:class:`~serving.core.sched.scheduler.Scheduler`. Each turn it

  1. takes in new requests and cancellations (a cancel ends the request and
     frees its pages before the next step is planned),
  2. asks the scheduler for a step plan (a ``serving.core.sched.step_plan.StepPlan`` of
     value rows: decode rows for running requests, prompt chunks within the
     token budget; admissions and preemptions already applied),
  3. dispatches the plan's prefill rows and decode rows as one step each,
  4. only then reads back the previous turn's tokens and streams them, so the
     device is already busy with the next step while the host works
     (JetStream's pipelining). A request that finished in step n may still
     have a token computed in step n+1; it is discarded.

Log probabilities (``TokenEvent.logprobs``): a step returns a small output
pytree (``serving.engine.sample.logprobs.StepOutput``); the loop reads its log-probability
arrays back only when a row of the step asked, and cuts each row's top list
to the k it asked for. Prompt log probabilities (echo): the request's prompt
chunks run the engine's prompt-logprobs prefill variant, whose per-token
results are collected at read-back and delivered whole on the request's first
event; the last prompt position is scored by the first generated token's
``logprobs`` entry. Such a request, and one with penalties, takes no
prefix-cache hit (``SchedRequest.prefix_cache``). ``max_tokens`` 0 (only
with prompt log probabilities) finishes with "length" and no token once the
prompt is computed (the token the step sampled is dropped).

Bursts: while prompts (not ``n`` choices) wait for open slots, the loop reads
back the step in flight before planning and takes in what arrived meanwhile,
so prompts arriving together share a few packed prefill steps instead of each
waiting behind one more small step (the pipelining is given up only then).

Structured output: a constrained request's mask for step n+1 depends on its
token of step n, so while one runs, the loop reads back the previous turn's
tokens *before* planning (the pipelining above is given up only then), feeds
them to the requests' llguidance matchers and fills the step's token bitmask
on the host (``serving.runtime.structured_steps`` over ``serving.core.structured_output``, in
llguidance's threads) before dispatching. A matcher that fails ends its request
with "error", not the loop.

Speculative decoding (``EngineConfig.speculative``): a verify step's rows are
dispatched and read back by ``serving.runtime.speculative_steps``, which also says
when the loop reads back before planning.

Host KV tier (``host_kv_cache_bytes`` > 0): cached pages evicted from the device
pool are copied to a host-memory LRU and prefix hits there reloaded
(``serving.runtime.host_tier_steps``: reads before anything writes the evicted pages,
loads before the steps, the host copies after them).

Disk KV tier (``kv_disk_dir``, under the host tier): pages the host tier evicts are
written to files by a writer thread, and every cached page when the loop stops; a new
request whose prefix continues on disk waits outside the scheduler while a reader thread
reads those pages into the host tier, then runs as a host-tier hit
(``serving.runtime.disk_tier_steps``).

LoRA adapters (an engine with ``max_loras`` > 0): a request naming one waits for
its adapter's device slot and is salted with the adapter's digest
(``serving.runtime.lora_admission``); :meth:`EngineLoop.load_lora` and
:meth:`EngineLoop.unload_lora` change the served adapters between steps.

Disaggregated serving (``connector``: a ``serving.replica.kv_connector.KvConnector``, set by
``xlaserve engine``): a request with ``kv_transfer`` waits outside the scheduler, its
pages reserved, while they are pulled, and is queued once they are in its prefix
cache; a ``kv_produce`` request's prompt pages are pinned and offered as it ends,
its final event saying where.

An exception in a step fails the requests in that step, not the server.
The asyncio side (:meth:`submit`, :meth:`cancel`) never touches device or
scheduler state: it hands requests to the thread through a queue and
receives events through ``loop.call_soon_threadsafe``.

Slow consumers: the thread never waits for a request's consumer (e.g. an HTTP
client that stopped reading its stream). Each request's events wait for the
consumer in a buffer of at most ``max_queued_events`` events; a token event
that would pass that bound is dropped and the request cancelled instead (its
pages freed within one step), and it ends with a "cancelled" event that says
why. So a stalled consumer costs at most that many events of memory and
stops costing compute at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import random
import threading
import time
from typing import AsyncIterator

from serving.config.engine_config import prefill_rows_bucket, token_bucket
from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    EngineStats,
    RequestRejectedError,
    TokenEvent,
    TokenLogprobs,
)
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.core.kv.disk_kv_store import DiskKVStore
from serving.core.kv.host_kv_cache import HostKVCache
from serving.core.kv.kv_cache_manager import KVCacheManager
from serving.core.kv.kv_events import KvEventJournal
from serving.core.sched.sched_request import PRIORITIES, SchedRequest, Status
from serving.core.sched.scheduler import Scheduler
from serving.engine.engine import Engine
from serving.engine.lora_registry import LoraRegistry
from serving.engine.verify_step import VerifyOutput
from serving.runtime import sampling_request
from serving.runtime.disk_tier_steps import DiskTier, disk_kv_stats, model_identity
from serving.runtime.host_tier_steps import HostTier, host_kv_stats
from serving.runtime.lora_admission import LoraAdmission
from serving.runtime.speculative_steps import SpecCounters, dispatch_verify
from serving.runtime.step_dispatch import dispatch_decode, dispatch_prefill, process_step
from serving.runtime.structured_steps import request_matcher, step_mask
from serving.runtime.turn_profile import TurnProfile

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED_EVENTS = 1024
"""Events (about one per token) a request's consumer may fall behind before the
request is cancelled: the server's ``stream_buffer_events``."""

DEFAULT_STARVATION_PREEMPTIONS = 3
"""A flex/batch request preempted more than this many times runs as default work
(the server's ``flex_starvation_preemptions``)."""

DEFAULT_STARVATION_SECONDS = 60.0
"""A flex/batch request waiting this long runs as default work (``flex_starvation_seconds``)."""


@dataclasses.dataclass(eq=False)
class _Sequence:
    """A request's asyncio side (event queue) and its scheduler state."""

    req: EngineRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    sched: SchedRequest
    first_token_time: float | None = None
    scheduled_time: float | None = None
    overflowed: bool = False  # the consumer fell max_queued_events behind (event-loop side only)
    prompt_logprobs: list | None = None  # [prompt_len] entries collected from prefill chunks
    first_event_sent: bool = False
    matcher: object = None  # llguidance.LLMatcher of a structured-output request (loop thread only)
    armed_by: int | None = None  # the token whose generation arms the matcher (until then: unconstrained)
    kv_bytes: int = 0  # KV pages pulled for it (disaggregated decode side)
    kv_seconds: float = 0.0
    lora: object = None  # the LoraGrant (device slot) it holds while queued or running
    disk_cached_tokens: int = 0  # prompt tokens whose pages were read from the disk KV tier


class EngineLoop:
    """In-process :class:`~serving.contract.engine_client.EngineClient` over one Engine.

    Args:
      engine: the device engine (its config sizes slots, pages and chunks).
      max_waiting: most requests waiting for a slot (those the open slots will
        take at the next steps do not count); beyond it submit() raises
        EngineOverloadedError (the gateway answers 503).
      max_waiting_tokens: most prompt tokens of those waiting requests (same).
      token_budget: most tokens computed per step (decode rows + prompt
        chunks); default: the prefill chunk plus one token per slot.
      enable_prefix_caching: reuse KV pages of identical prompt prefixes.
      max_queued_events: most events of one request waiting for its consumer;
        one more cancels the request (see the module docstring). None: no bound.
      tokenizer: the served tokenizer, for structured output (llguidance's
        view of it is built at the first constrained request, or shared with
        the gateway that checked it: about 2 s for Gemma). None: requests with
        ``structured_output`` are rejected.
      host_kv_cache_bytes: the host KV tier's bound in bytes (0: no host tier).
      kv_disk_dir: the disk KV tier's directory under the host tier (None: no disk tier;
        needs the host tier); ``kv_disk_max_bytes`` bounds its files (> 0).
      kv_disk_model_id: the served model's identity in the page files (None: the model's
        config; the command line adds the weights' source, dtype and quantization).
      starvation_preemptions, starvation_seconds: the scheduler's starvation guard for
        flex-class (``"flex"``/``"batch"``) work: promoted to default once preempted more
        than this many times or waiting this long (None: that bound is off).
      lora_modules: {name: PEFT adapter folder} served from the start (the engine needs
        ``max_loras`` > 0).
      max_cpu_loras: read adapters kept in host memory (``serving.engine.lora_registry``).

    Raises:
      ValueError: `max_queued_events` below 2 (a token event and the final one); LoRA
        modules for an engine without LoRA; a disk tier without a host tier or a bound.
      model.lora_adapter.LoraAdapterError: a LoRA module that cannot be served.
    """

    def __init__(self, engine: Engine, max_waiting: int = 256, max_waiting_tokens: int | None = None,
                 token_budget: int | None = None, enable_prefix_caching: bool = True,
                 max_queued_events: int | None = DEFAULT_MAX_QUEUED_EVENTS,
                 tokenizer: TextTokenizer | None = None, host_kv_cache_bytes: int = 0,
                 starvation_preemptions: int | None = DEFAULT_STARVATION_PREEMPTIONS,
                 starvation_seconds: float | None = DEFAULT_STARVATION_SECONDS,
                 lora_modules: dict[str, str] | None = None, max_cpu_loras: int | None = None,
                 kv_disk_dir: str | None = None, kv_disk_max_bytes: int = 0, kv_disk_model_id: str | None = None):
        if max_queued_events is not None and max_queued_events < 2:
            raise ValueError(f"max_queued_events must be >= 2, got {max_queued_events}")
        self.engine = engine
        self.cfg = cfg = engine.cfg
        self.max_waiting = max_waiting
        self.max_queued_events = max_queued_events
        self.max_waiting_tokens = max_waiting_tokens or max_waiting * cfg.max_model_len
        self.kv_events = KvEventJournal()  # the prefix cache's page hashes, for routers
        self.host_kv = HostKVCache(host_kv_cache_bytes) if host_kv_cache_bytes > 0 and enable_prefix_caching else None
        self.kv = KVCacheManager(cfg.num_pages, cfg.page_size, enable_prefix_caching, self.kv_events, self.host_kv,
                                 kv_format=cfg.kv_format or "")
        self.host_tier = None if self.host_kv is None else HostTier(engine, self.kv, self.host_kv, self.kv_events)
        self.disk_kv = self.disk_tier = None
        if kv_disk_dir is not None:
            if self.host_kv is None:
                raise ValueError("the disk KV tier sits under the host tier: it needs host_kv_cache_bytes > 0 "
                                 "and prefix caching")
            self.disk_kv = DiskKVStore(kv_disk_dir, kv_disk_max_bytes, kv_disk_model_id or model_identity(
                engine.model_cfg), engine.state.kv_cache.kv_format)
            self.disk_tier = DiskTier(self.disk_kv, self.kv, self.kv_events, wake=self.wake)
            self.disk_tier.attach(self.host_kv)
        self.scheduler = Scheduler(
            self.kv, num_slots=cfg.max_slots,
            token_budget=token_budget or cfg.prefill_chunk + cfg.max_slots,
            max_prefill_tokens=cfg.prefill_chunk, max_prefill_seqs=cfg.max_prefill_seqs,
            speculative=cfg.speculative, starvation_preemptions=starvation_preemptions,
            starvation_seconds=starvation_seconds, prefill_bucket=lambda n: token_bucket(n, cfg),
            prefill_rows=lambda n: prefill_rows_bucket(n, cfg))
        self.spec_counters = SpecCounters()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._by_id: dict[str, _Sequence] = {}
        self.tokenizer = tokenizer
        self._constrained: set[_Sequence] = set()  # live requests with a matcher
        # Admission accounting, under _lock (see submit()): the token counts of the
        # requests not yet admitted, in the order they will be admitted (the
        # scheduler's queue as of the last turn, then the inbox), and the slots
        # they can take at the next step.
        self._queued_tokens: list[int] = []
        self._inbox_tokens: collections.deque[int] = collections.deque()
        self._open_slots = cfg.max_slots
        self._stats = EngineStats()  # replaced (not mutated) by the loop thread each turn
        self._pings: list[asyncio.Future] = []  # taken in this turn, resolved after its stats
        self._num_preemptions = 0
        self.profile = TurnProfile()  # where the loop's turns spend their time (loop thread only)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_step = None  # optional hook(plan) for tests and tracing, called on the loop thread
        self.connector = None  # serving.replica.kv_connector.KvConnector of a replica in disaggregated serving
        self.lora: LoraAdmission | None = None
        if cfg.max_loras > 0:
            self.lora = LoraAdmission(LoraRegistry(engine, max_cpu_loras), lambda seq: self.scheduler.add(seq.sched),
                                      lambda seq, why: self._finish(seq, "error", why))
        for name, path in (lora_modules or {}).items():
            if self.lora is None:
                raise ValueError("LoRA modules need an engine with max_loras > 0")
            self.lora.registry.add(name, path)

    def _lora_stats(self, sched) -> dict:
        """The adapters of running and waiting requests, and the slots (EngineStats' LoRA fields)."""
        if self.lora is None:
            return {}

        def names(reqs) -> tuple[str, ...]:
            seqs = (self._by_id.get(r.request_id) for r in reqs)
            return tuple(sorted({s.req.lora_name for s in seqs if s is not None and s.req.lora_name}))

        waiting = set(names(sched.waiting)) | {s.req.lora_name for s in self.lora.waiting}
        return {"lora_running": names(sched.running), "lora_waiting": tuple(sorted(waiting)),
                "max_loras": self.cfg.max_loras}

    # -- EngineClient ------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        """See EngineClient.kv_capacity_tokens: every page but the reserved page 0."""
        return (self.cfg.num_pages - 1) * self.cfg.page_size

    def is_ready(self) -> bool:
        return (self._ready.is_set() and not self._draining.is_set()
                and self._thread is not None and self._thread.is_alive())

    @property
    def vision(self):
        """The engine's ``VisionSpec`` (None: it takes no images)."""
        enc = self.engine.vision
        if enc is None:
            return None
        from serving.contract.engine_client import VisionSpec

        c = enc.cfg
        return VisionSpec(c.siglip.image_size, c.mm_tokens_per_image, c.image_token_id, c.boi_token_id,
                          c.eoi_token_id)

    def stats(self) -> EngineStats:
        """See EngineClient.stats (a snapshot from the last loop turn)."""
        return self._stats

    def submit(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """See EngineClient.submit. Raises at call time (not on first iteration).

        A request counts as waiting only when it finds no open slot: the
        requests not yet admitted (queued in the scheduler, or handed over and
        not yet taken in) fill the open slots first, so a burst of up to
        ``max_waiting`` + open-slot-count requests at an idle loop is accepted.

        A request with ``parent_id`` (one of ``n`` choices) submitted while its
        parent is known joins the parent's family: the scheduler forks it from
        the computed prompt (``serving.core.sched.scheduler``) instead of computing it again.

        Raises:
          RequestRejectedError: the request can never be served (too long for
            the context window or the KV cache, empty, bad ids, unknown priority,
            a structured output that does not compile or no tokenizer for one).
          EngineOverloadedError: ``max_waiting`` requests (or ``max_waiting_tokens``
            prompt tokens) already wait beyond the open slots, or the server is draining.
        """
        self._validate(request)
        n = len(request.prompt_ids)
        s = request.sampling
        matcher = request_matcher(self.tokenizer, request)
        seed = random.getrandbits(32) if s.seed is None else int(s.seed) & 0xFFFFFFFF
        stop_ids = () if s.ignore_eos else tuple(s.stop_token_ids)
        settings = sampling_request.settings(s, seed, self.engine.model_cfg.vocab_size, stop_ids)
        sched = SchedRequest(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids),
            max_tokens=s.max_tokens, stop_token_ids=stop_ids,
            priority=PRIORITIES[request.priority], salt=request.cache_salt, sampling=settings,
            prefix_cache=settings.prompt_logprobs < 0 and not settings.uses_penalties,
            parent_id=request.parent_id,
            speculate=matcher is None and request.lora_name is None and s.num_speculative_tokens != 0,
            max_drafts=s.num_speculative_tokens,
            images=tuple((im.start, im.end, im.digest) for im in request.images))
        seq = _Sequence(req=request, loop=asyncio.get_running_loop(), events=asyncio.Queue(), sched=sched,
                        matcher=matcher, armed_by=None if matcher is None else s.structured_output.after_token_id)
        if s.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * n
        with self._lock:
            if self._draining.is_set():
                raise EngineOverloadedError("the server is shutting down")
            queued = self._queued_tokens + list(self._inbox_tokens)
            if len(queued) >= self._open_slots:  # no open slot left for this one: it waits
                waiting = queued[self._open_slots:]
                reqs, toks = len(waiting), sum(waiting)
                if reqs >= self.max_waiting or toks + n > self.max_waiting_tokens:
                    raise EngineOverloadedError(
                        f"{reqs} requests ({toks} prompt tokens) are already waiting; retry later")
            self._inbox_tokens.append(n)
            self._inbox.put(("submit", seq))  # under the lock: the inbox and _inbox_tokens keep one order
        return self._stream(seq)

    async def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    @property
    def serves_lora(self) -> bool:
        """Whether LoRA adapters can be loaded (the engine has ``max_loras`` > 0)."""
        return self.lora is not None

    def lora_names(self) -> list[str]:
        """The LoRA adapters served now (any thread; a snapshot)."""
        return [] if self.lora is None else list(self.lora.registry.names())

    def lora_digests(self) -> dict[str, str]:
        """{adapter name: digest of its weights and config} served now ({} without LoRA): the
        digest its requests' prefix-cache salts join (``lora_salt``; any thread, a snapshot)."""
        if self.lora is None:
            return {}
        reg = self.lora.registry
        return {n: d for n in reg.names() if (d := reg.digest(n)) is not None}

    async def load_lora(self, name: str, path: str) -> None:
        """Serves the PEFT adapter in folder ``path`` as ``name`` from the next step on.

        Raises:
          ValueError: no LoRA on this engine, or the name is taken;
          model.lora_adapter.LoraAdapterError: the folder cannot be served (says why).
        """
        await self._lora_control("load", name, path)

    async def unload_lora(self, name: str) -> None:
        """Stops serving ``name`` (its cached KV pages are never reused: see ``lora_admission``).

        Raises:
          KeyError: not served; serving.engine.lora_registry.LoraInUseError: requests use it.
        """
        await self._lora_control("unload", name, None)

    async def _lora_control(self, op: str, name: str, path: str | None) -> None:
        if self.lora is None:
            raise ValueError("this server was started without LoRA (--max-loras 0)")
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("lora", (op, name, path, fut)))
        await fut

    def wake(self) -> None:
        """Makes an idle loop turn now (any thread)."""
        self._inbox.put(("wake", None))

    def ping(self) -> asyncio.Future:
        """A future the loop thread resolves (to None) at its next turn: proof that it turns.
        Resolved once that turn has published its stats, so :meth:`stats` read after it
        reflects every submit and cancel made before the ping."""
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("ping", fut))
        return fut

    # -- lifecycle ---------------------------------------------------------------

    def start(self, warmup: bool = True, warmup_decode: bool = True) -> None:
        """Starts the loop thread (after an optional warmup compile of the common shapes;
        the decode ones only with ``warmup_decode``)."""
        if warmup:
            t0 = time.perf_counter()
            self.engine.warmup(decode=warmup_decode)
            if self.host_tier is not None:
                self.host_tier.warmup()
            log.info("warmup compiled %d programs in %.1f s", len(self.engine.compile_times),
                     time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._run, name="xlaserve-engine", daemon=True)
        self._thread.start()
        self._ready.set()

    def drain(self) -> None:
        """Stops admitting: readiness turns false and new submits get EngineOverloadedError.
        Requests already submitted run to their end."""
        self._draining.set()

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id) + self._inbox.qsize()

    def stop(self) -> None:
        """Ends the loop; unfinished requests end with finish_reason "cancelled"."""
        self._draining.set()
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=30 if self.disk_tier is None else 120)

    # -- asyncio side ----------------------------------------------------------------

    async def _stream(self, seq: _Sequence) -> AsyncIterator[TokenEvent]:
        done = False
        try:
            while True:
                ev: TokenEvent = await seq.events.get()
                yield ev
                if ev.finish_reason is not None:
                    done = True
                    return
        finally:
            if not done:  # the consumer went away: stop generating
                self._inbox.put(("cancel", seq.req.request_id))

    def _validate(self, request: EngineRequest) -> None:
        cfg = self.cfg
        sampling_request.validate_request(request, self.engine.model_cfg.vocab_size, cfg.max_model_len,
                                          cfg.num_pages - 1, self.scheduler.pages_needed_alone, PRIORITIES)
        if request.images:
            # an image is computed in one step: it must fit what one step's prompt budget can be
            sampling_request.validate_images(request, self.engine.vision,
                                             min(cfg.prefill_chunk, self.scheduler.token_budget - cfg.max_slots))
        if request.lora_name is not None:
            if self.lora is None or request.lora_name not in self.lora.registry.names():
                raise RequestRejectedError(f"LoRA adapter {request.lora_name!r} is not loaded")
            if request.kv_produce or request.kv_transfer is not None:
                raise RequestRejectedError("KV transfer of LoRA requests is not supported")
        if request.kv_produce or request.kv_transfer is not None:
            if self.connector is None:
                raise RequestRejectedError("this engine takes no part in KV transfer (xlaserve engine does)")
            why = request.kv_transfer and self.connector.check(request.kv_transfer, request.prompt_ids,
                                                               request.cache_salt)
            if why:
                raise RequestRejectedError(why)

    # -- engine thread -------------------------------------------------------------

    def _emit(self, seq: _Sequence, ids: tuple[int, ...], reason: str | None = None,
              error: str | None = None, logprobs: tuple[TokenLogprobs, ...] | None = None,
              kv_transfer=None) -> None:
        r = seq.sched
        prompt_lp = None
        if seq.prompt_logprobs is not None and not seq.first_event_sent and (ids or reason):
            prompt_lp = tuple(seq.prompt_logprobs)
        seq.first_event_sent = seq.first_event_sent or bool(ids) or reason is not None
        ev = TokenEvent(
            request_id=seq.req.request_id, token_ids=ids, finish_reason=reason,
            prompt_tokens=len(r.prompt_ids), cached_tokens=r.cached_tokens or 0,
            host_cached_tokens=r.host_cached_tokens, disk_cached_tokens=seq.disk_cached_tokens,
            completion_tokens=len(r.output_ids), first_token_time=seq.first_token_time,
            scheduled_time=seq.scheduled_time, num_preemptions=r.num_preemptions, error=error,
            logprobs=logprobs, prompt_logprobs=prompt_lp, num_draft_tokens=r.num_draft_tokens,
            num_accepted_tokens=r.num_accepted_tokens, kv_transfer=kv_transfer,
            kv_transfer_bytes=seq.kv_bytes, kv_transfer_seconds=seq.kv_seconds)
        try:
            seq.loop.call_soon_threadsafe(self._deliver, seq, ev)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            log.debug("request %s: event loop closed, event dropped", seq.req.request_id)

    def _deliver(self, seq: _Sequence, ev: TokenEvent) -> None:
        """Queues `ev` for the consumer (on the consumer's event loop): a token event
        beyond ``max_queued_events`` is dropped and the request cancelled; the final
        event of such a request says "cancelled" with the reason."""
        bound = self.max_queued_events
        if seq.overflowed:
            if ev.finish_reason is None:
                return  # generated before the cancel took effect: nobody will read it
            ev = dataclasses.replace(ev, token_ids=(), finish_reason="cancelled", error=(
                f"the consumer stopped reading: {bound} events were waiting for it "
                f"(stream_buffer_events); the request was cancelled"))
        elif bound is not None and ev.finish_reason is None and seq.events.qsize() >= bound - 1:
            seq.overflowed = True  # the last place is kept for the final event
            log.warning("request %s: %d events unread, cancelling", seq.req.request_id, bound - 1)
            self._inbox.put(("cancel", seq.req.request_id))
            return
        seq.events.put_nowait(ev)

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None,
                ids: tuple[int, ...] = (), logprobs: tuple[TokenLogprobs, ...] | None = None) -> None:
        """Ends a request: frees its slot and pages, sends the final event (with ``ids``)."""
        if seq.sched.status is Status.FINISHED:
            return
        if self.lora is not None:
            if self.lora.drop(seq):  # waiting for an adapter slot: never queued
                seq.sched.status = Status.FINISHED
            self.lora.release(seq)
        if self.disk_tier is not None and self.disk_tier.drop(seq.req.request_id):  # its pages being read
            seq.sched.status = Status.FINISHED
        offer = None
        if self.connector is not None:  # disaggregated serving (serving.replica.kv_connector)
            if self.connector.drop(seq.req.request_id):  # still waiting for its KV pages
                seq.sched.status = Status.FINISHED
            elif seq.req.kv_produce and reason in ("stop", "length"):
                offer = self.connector.request_finished(seq.req.request_id, seq.sched.prompt_ids,
                                                        seq.req.cache_salt)
        self.scheduler.finish(seq.sched, reason)
        self._by_id.pop(seq.req.request_id, None)
        self._constrained.discard(seq)
        self._emit(seq, ids, reason, error, logprobs, kv_transfer=offer)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                with self._lock:  # from the inbox to the scheduler's queue, counted all along
                    self._queued_tokens.append(self._inbox_tokens.popleft())
                if item.req.request_id in self._by_id:
                    item.sched.status = Status.FINISHED
                    self._emit(item, (), "error", f"request id {item.req.request_id!r} is already running")
                    continue
                self._by_id[item.req.request_id] = item
                if item.matcher is not None:
                    self._constrained.add(item)
                if item.req.lora_name is not None:
                    self.lora.admit(item)  # queued once its adapter holds a device slot
                elif item.req.kv_transfer is not None and self.connector.receive(
                        item, self.scheduler.watermark_pages if self.scheduler.running else 0):
                    pass  # queued once its pages are in (none to receive into: it computes the prompt)
                elif self.disk_tier is None or not self.disk_tier.park(item):
                    self.scheduler.add(item.sched)  # (parked: queued once its disk pages are read)
            elif kind == "cancel":
                seq = self._by_id.get(item)
                if seq is not None:
                    self._finish(seq, "cancelled")
            elif kind == "ping":
                self._pings.append(item)
            elif kind == "lora":
                op, name, path, fut = item
                try:
                    self.lora.control(op, name, path)
                    result = (fut.set_result, None)
                except Exception as e:  # refused: the caller's error, not the loop's
                    result = (fut.set_exception, e)
                fut.get_loop().call_soon_threadsafe(
                    lambda f=fut, r=result: f.done() or r[0](r[1]))

    def _run(self) -> None:
        pending: list = []
        while not self._stop.is_set():
            try:
                pending = self._iteration(pending)
            except Exception as e:  # a bug in planning must not kill the loop thread
                log.exception("engine loop iteration failed; failing the running requests")
                pending = []
                for seq in [s for s in self._by_id.values() if s.sched.status is Status.RUNNING]:
                    self._finish(seq, "error", f"engine error: {e}")
        for seq in list(self._by_id.values()):
            self._finish(seq, "cancelled")
        if self.disk_tier is not None:  # the cached pages to disk: a restarted server finds them
            try:
                self.disk_tier.save_all(self.engine, self.host_tier.chunk_pages)
            except Exception:
                log.exception("KV disk tier: saving the cached pages at stop failed")
            self.disk_tier.close()

    def _iteration(self, pending):
        """One loop turn: plan, dispatch the prefill and decode steps, then read back ``pending``.

        Returns the steps dispatched this turn (read back next turn).
        """
        sched, prof = self.scheduler, self.profile
        idle = not pending and not sched.waiting and not sched.running
        self._drain_inbox(block=idle)
        if self.lora is not None and self.lora.waiting:  # slots freed by requests that ended
            self.lora.retry()
        prof.start_turn()
        had_pending = bool(pending)
        if self.host_tier is not None:  # evicted pages out before the connector writes any
            self.host_tier.save_evicted()
        for got in self.connector.get_finished()[1] if self.connector is not None else ():
            if got.error is not None:
                self._finish(got.seq, "error", got.error)
            else:  # its pages are in the prefix cache: admitted with a hit of all of them
                got.seq.kv_bytes, got.seq.kv_seconds = got.nbytes, got.seconds
                self.scheduler.add(got.seq.sched)
        for seq in self.disk_tier.ready() if self.disk_tier is not None else ():
            if seq.sched.status is not Status.FINISHED:  # its disk pages are in the host tier now
                self.scheduler.add(seq.sched)
        # Prompts wait for open slots (a burst arriving): plan after the step in flight
        # ends, taking in what arrives meanwhile, instead of queueing a step of only the
        # prompts here now behind it. Pipelined, every arrival waited for one more step:
        # 32 prompts arriving at once got their first token after ~3 small prefill steps
        # instead of ~2 packed ones (benchmarks/RESULTS.md). Decode-only turns (nothing
        # waiting) stay pipelined, and so do turns where only ``n`` choices wait: they fork
        # from their parent while it runs, which reading it back first could end (a parent
        # with max_tokens 1).
        burst = bool(pending) and sched.num_open_slots > 0 and any(r.parent_id is None for r in sched.waiting)
        if pending and (burst or any(s.sched.status is Status.RUNNING for s in self._constrained)
                        or any(isinstance(step[0], VerifyOutput) for step in pending)
                        or sched.speculation_wants_tokens()):
            # A constrained request's next mask needs its last token, drafts need the
            # host's tokens, a verify step settles its computed counts: read back first.
            for step in pending:
                process_step(self, *step)
            pending = []
            if burst:
                self._drain_inbox(block=False)
        t = time.perf_counter()
        plan = sched.schedule()
        prof.add("plan", time.perf_counter() - t)
        if plan.needs_sync:  # preemption needs every token id: read back first
            for step in pending:
                process_step(self, *step)
            pending = []
            t = time.perf_counter()
            plan = sched.schedule()
            prof.add("plan", time.perf_counter() - t)
        t = time.perf_counter()
        now = time.time()
        for row in plan.prefill:
            seq = self._by_id[row.request_id]
            if seq.scheduled_time is None:
                seq.scheduled_time = now
        self._num_preemptions += len(plan.preempted)
        with self._lock:  # sched.waiting is in admission order after schedule()
            self._queued_tokens = [r.num_tokens for r in sched.waiting]
            self._open_slots = sched.num_open_slots
        kv, spec = self.kv, self.spec_counters
        self._stats = EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + (len(self.lora.waiting) if self.lora is not None else 0)
            + (self.disk_tier.num_parked if self.disk_tier is not None else 0),
            waiting_prompt_tokens=sum(r.num_tokens for r in sched.waiting),
            kv_cache_usage=kv.usage, kv_pages_used=kv.num_pages - 1 - kv.num_free,
            kv_pages_total=kv.num_pages - 1,
            prefix_cache_queries=kv.queries, prefix_cache_hits=kv.hits,
            num_preemptions=self._num_preemptions, spec_verify_rows=spec.verify_rows,
            spec_draft_tokens=spec.draft_tokens, spec_accepted_tokens=spec.accepted_tokens,
            spec_drafted_per_position=tuple(spec.drafted_per_position),
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            spec_num_tokens_now=sched.speculative_tokens_now(),
            **host_kv_stats(self.host_kv), **disk_kv_stats(self.disk_kv), **self._lora_stats(sched), turn_profile=self.profile.snapshot())
        for fut in self._pings:
            fut.get_loop().call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
        self._pings.clear()
        prof.add("plan", time.perf_counter() - t)
        if self.on_step is not None:
            self.on_step(plan)
        failed: list[tuple[_Sequence, str]] = []  # matchers that failed while filling masks
        if self.host_tier is not None:
            self.host_tier.before_dispatch()
        t0 = time.perf_counter()
        prefill = dispatch_prefill(self, plan, failed)
        t1 = time.perf_counter()
        decode = dispatch_decode(self, plan, failed)
        prof.add("dispatch_prefill", t1 - t0)
        prof.add("dispatch_decode", time.perf_counter() - t1)
        dispatched = [d for d in (prefill, decode, dispatch_verify(self, plan)) if d]
        for seq, error in failed:  # after dispatch: the step already holds their rows
            self._finish(seq, "error", error)
        # Read back the previous turn's tokens while this turn's steps run.
        for step in pending:
            process_step(self, *step)
        if self.host_tier is not None:  # and the evicted pages' copies into host memory
            self.host_tier.after_dispatch()
        if dispatched or had_pending:  # (an idle turn is not counted)
            prof.end_turn(sum(len(row.token_ids) for row in plan.prefill), len(plan.decode))
        return dispatched

    def _token_mask(self, seqs: list[_Sequence], samples: list[bool], failed: list):
        """The step's structured-output bitmask (``serving.runtime.structured_steps.step_mask``)."""
        if not self._constrained:
            return None
        return step_mask(self.tokenizer, self.engine.model_cfg.vocab_size, seqs, samples, failed)
