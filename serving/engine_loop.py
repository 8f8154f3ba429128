"""The batching loop: continuous batching over the engine's slots, behind EngineClient.

One background thread owns the :class:`~serving.engine.Engine`. Each
iteration it

  1. takes in new requests and cancellations,
  2. admits waiting requests into free slots when their pages fit (all pages
     for prompt + max_tokens are reserved at admission, so a running request
     never runs out of pages),
  3. dispatches one prefill step (one chunk of the oldest unfinished prompt,
     packed with others up to ``max_prefill_seqs``), then one decode step over
     every running slot,
  4. only then reads back the previous iteration's tokens and streams them,
     so the device is already busy with the next step while the host works
     (JetStream's pipelining). A request that finished in step n may still
     have a token computed in step n+1; it is discarded.

Finished, cancelled and failed requests give their slot and pages back at
once. An exception in a step fails the requests in that step, not the server.

The asyncio side (:meth:`submit`, :meth:`cancel`) never touches device state:
it hands requests to the thread through a queue and receives events through
``loop.call_soon_threadsafe``.
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

import numpy as np

from serving.engine import DecodeRow, Engine, PrefillChunk
from serving.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    RequestRejectedError,
    TokenEvent,
)
from serving.page_allocator import PageAllocator

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Sequence:
    req: EngineRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    seed: int
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    num_prefilled: int = 0  # prompt tokens whose K/V are in the cache
    num_dispatched: int = 0  # generated tokens that exist on device
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    cancel_requested: bool = False
    first_token_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def sampling_row(self) -> tuple[float, int, float, int]:
        s = self.req.sampling
        return (float(s.temperature), int(s.top_k), float(s.top_p), self.seed)


class EngineLoop:
    """In-process :class:`~serving.engine_client.EngineClient` over one Engine.

    Args:
      engine: the device engine (its config sizes slots and pages).
      max_waiting: bound on requests waiting for a slot; beyond it submit()
        raises EngineOverloadedError (the gateway answers 503).
    """

    def __init__(self, engine: Engine, max_waiting: int = 256):
        self.engine = engine
        self.cfg = engine.cfg
        self.max_waiting = max_waiting
        self._allocator = PageAllocator(self.cfg.num_pages)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._by_id: dict[str, _Sequence] = {}
        self._slots: list[_Sequence | None] = [None] * self.cfg.max_slots
        self._num_queued = 0  # submitted but not yet admitted (read from any thread)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- EngineClient ------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    def is_ready(self) -> bool:
        return self._ready.is_set() and self._thread is not None and self._thread.is_alive()

    def submit(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """See EngineClient.submit. Raises at call time (not on first iteration)."""
        self._validate(request)
        with self._lock:
            if self._num_queued >= self.max_waiting:
                raise EngineOverloadedError(
                    f"{self._num_queued} requests are already waiting; retry later")
            self._num_queued += 1
        loop = asyncio.get_running_loop()
        seed = request.sampling.seed
        if seed is None:
            seed = random.getrandbits(32)
        seq = _Sequence(req=request, loop=loop, events=asyncio.Queue(), seed=int(seed) & 0xFFFFFFFF)
        self._inbox.put(("submit", seq))
        return self._stream(seq)

    async def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    # -- lifecycle ---------------------------------------------------------------

    def start(self, warmup: bool = True) -> None:
        """Starts the loop thread (after an optional warmup compile of the common shapes)."""
        if warmup:
            t0 = time.perf_counter()
            self.engine.warmup()
            log.info("warmup compiled %d programs in %.1f s", len(self.engine.compile_times),
                     time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._run, name="xlaserve-engine", daemon=True)
        self._thread.start()
        self._ready.set()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

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
        n = len(request.prompt_ids)
        s = request.sampling
        if n == 0:
            raise RequestRejectedError("the prompt is empty")
        if s.max_tokens < 1:
            raise RequestRejectedError("max_tokens must be >= 1")
        if n + s.max_tokens > cfg.max_model_len:
            raise RequestRejectedError(
                f"prompt ({n} tokens) plus max_tokens ({s.max_tokens}) exceeds the context "
                f"window of {cfg.max_model_len} tokens")
        vocab = self.engine.model_cfg.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if request.request_id in self._by_id:
            raise RequestRejectedError(f"request id {request.request_id!r} is already running")

    # -- engine thread -------------------------------------------------------------

    def _emit(self, seq: _Sequence, ev: TokenEvent) -> None:
        seq.loop.call_soon_threadsafe(seq.events.put_nowait, ev)

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None,
                ids: tuple[int, ...] = ()) -> None:
        """Ends a request: frees its slot and pages, sends the final event (with ``ids``)."""
        if seq.finished:
            return
        seq.finished = True
        if seq.slot is not None:
            self._slots[seq.slot] = None
            seq.slot = None
        else:
            try:
                self._waiting.remove(seq)
                with self._lock:
                    self._num_queued -= 1
            except ValueError:
                pass
        if seq.pages:
            self._allocator.free(seq.pages)
            seq.pages = []
        self._by_id.pop(seq.req.request_id, None)
        self._emit(seq, self._event(seq, ids, reason, error))

    def _event(self, seq: _Sequence, ids: tuple[int, ...], reason: str | None = None,
               error: str | None = None) -> TokenEvent:
        return TokenEvent(
            request_id=seq.req.request_id, token_ids=ids, finish_reason=reason,
            prompt_tokens=seq.prompt_len, cached_tokens=0,
            completion_tokens=len(seq.output_ids), first_token_time=seq.first_token_time,
            error=error)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self._by_id[item.req.request_id] = item
                self._waiting.append(item)
            elif kind == "cancel":
                seq = self._by_id.get(item)
                if seq is not None:
                    self._finish(seq, "cancelled")

    def _admit(self) -> None:
        """Moves waiting requests into free slots, FIFO, while their pages fit."""
        ps = self.cfg.page_size
        while self._waiting and None in self._slots:
            seq = self._waiting[0]
            total = min(seq.prompt_len + seq.req.sampling.max_tokens, self.cfg.max_model_len)
            need = -(-total // ps)
            if need > self._allocator.num_free:
                return  # head-of-line waits for pages (it always fits an empty pool)
            self._waiting.popleft()
            with self._lock:
                self._num_queued -= 1
            seq.pages = self._allocator.allocate(need)
            seq.slot = self._slots.index(None)
            self._slots[seq.slot] = seq

    def _plan_prefill(self) -> list[tuple[PrefillChunk, _Sequence, bool]]:
        budget = self.cfg.prefill_chunk
        plan = []
        for seq in self._slots:
            if seq is None or seq.num_prefilled >= seq.prompt_len:
                continue
            if len(plan) == self.cfg.max_prefill_seqs or budget == 0:
                break
            n = min(seq.prompt_len - seq.num_prefilled, budget)
            ids = list(seq.req.prompt_ids[seq.num_prefilled:seq.num_prefilled + n])
            last = seq.num_prefilled + n == seq.prompt_len
            plan.append((PrefillChunk(seq.slot, ids, seq.num_prefilled, seq.pages, seq.sampling_row),
                         seq, last))
            budget -= n
        return plan

    def _run(self) -> None:
        pending: list[tuple[object, list[tuple[_Sequence, int]]]] = []
        while not self._stop.is_set():
            try:
                pending = self._iteration(pending)
            except Exception as e:  # a bug in planning must not kill the loop thread
                log.exception("engine loop iteration failed; failing the running requests")
                pending = []
                for seq in [s for s in self._slots if s is not None]:
                    self._finish(seq, "error", f"engine error: {e}")
        for seq in list(self._by_id.values()):
            self._finish(seq, "cancelled")

    def _iteration(self, pending):
        """One loop turn: admit, dispatch a prefill and a decode step, then read back ``pending``.

        Returns the steps dispatched this turn (read back next turn).
        """
        idle = not pending and not self._waiting and all(s is None for s in self._slots)
        self._drain_inbox(block=idle)
        self._admit()
        dispatched = [d for d in (self._dispatch_prefill(), self._dispatch_decode()) if d]
        # Read back the previous turn's tokens while this turn's steps run.
        for out, owners in pending:
            self._process(out, owners)
        return dispatched

    def _dispatch_prefill(self):
        """Dispatches one prefill step; returns (tokens, [(seq, row)]) for prompts it completes."""
        plan = self._plan_prefill()
        if not plan:
            return None
        try:
            out = self.engine.prefill([c for c, _, _ in plan])
        except Exception as e:  # a failed step fails its requests, not the server
            log.exception("prefill step failed")
            for _, seq, _ in plan:
                self._finish(seq, "error", f"prefill failed: {e}")
            return None
        owners = []
        for i, (chunk, seq, last) in enumerate(plan):
            seq.num_prefilled += len(chunk.tokens)
            if last:
                seq.num_dispatched = 1
                owners.append((seq, i))
        return out, owners

    def _dispatch_decode(self):
        """Dispatches one decode step over every running slot with tokens left to generate.

        A slot whose prompt finished in this turn's prefill joins at once: its
        first token is already in the device's slot_tokens, and device steps run in order.
        """
        rows, row_seqs = [], []
        for seq in self._slots:
            if (seq is None or seq.num_prefilled < seq.prompt_len or seq.num_dispatched == 0
                    or seq.num_dispatched >= seq.req.sampling.max_tokens):
                continue
            rows.append(DecodeRow(seq.slot, seq.prompt_len + seq.num_dispatched - 1, seq.pages,
                                  seq.sampling_row))
            row_seqs.append(seq)
        if not rows:
            return None
        try:
            out = self.engine.decode(rows)
        except Exception as e:
            log.exception("decode step failed")
            for seq in row_seqs:
                self._finish(seq, "error", f"decode failed: {e}")
            return None
        for seq in row_seqs:
            seq.num_dispatched += 1
        return out, [(seq, i) for i, seq in enumerate(row_seqs)]

    def _process(self, out, owners: list[tuple[_Sequence, int]]) -> None:
        try:
            tokens = np.asarray(out)
        except Exception as e:
            log.exception("step failed")
            for seq, _ in owners:
                self._finish(seq, "error", f"step failed: {e}")
            return
        now = time.time()
        for seq, i in owners:
            if seq.finished:
                continue  # finished or cancelled while this step was in flight
            tok = int(tokens[i])
            seq.output_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            s = seq.req.sampling
            if not s.ignore_eos and tok in s.stop_token_ids:
                self._finish(seq, "stop", ids=(tok,))
            elif len(seq.output_ids) >= s.max_tokens:
                self._finish(seq, "length", ids=(tok,))
            else:
                self._emit(seq, self._event(seq, (tok,)))
