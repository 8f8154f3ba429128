"""The embedding loop: batches embedding requests onto the embedding engine, behind EmbeddingClient.

One background thread owns the :class:`~serving.engine.embedding_engine.EmbeddingEngine`. Each
turn it takes in what arrived, then runs steps of waiting inputs, oldest request first (``batch``
priority only when no ``default`` work waits), each step as many inputs as fit
(``EmbeddingEngine.rows_per_step`` of the step's longest); inputs of several requests share a
step, and a request's inputs may span steps. A request's future is resolved once all of its
inputs are embedded, and the loop logs how many steps its inputs took ("... in N steps").
A reranker (``serve --task rerank``) runs on the same loop: :meth:`EmbeddingLoop.score` queues
(query, document) inputs with their token-type starts, and each input's one-wide "embedding" is
its score. No KV cache pages are held, so nothing is preempted or freed.

A request is checked when it is submitted (:meth:`EmbeddingLoop.embed`): no inputs, an empty
input, one longer than ``max_model_len`` or a token id outside the vocabulary is a
``RequestRejectedError`` naming the input, and nothing of it is queued. An exception in a step
fails the requests with inputs in that step, not the loop nor the other waiting requests.
The asyncio side never touches the engine: requests go to the thread through a queue and come
back through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
from typing import Sequence

import numpy as np

from serving.contract.engine_client import EngineOverloadedError, EngineStats, RequestRejectedError
from serving.engine.embedding_engine import EmbeddingEngine

log = logging.getLogger(__name__)

__all__ = ["EmbeddingLoop"]


@dataclasses.dataclass
class _Request:
    inputs: list[list[int]]
    type_starts: list[int] | None
    priority: str
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    out: np.ndarray
    next_input: int = 0  # inputs before this one are in a step already
    done_inputs: int = 0
    failed: bool = False
    steps: int = 0  # steps that held any of its inputs


class EmbeddingLoop:
    """Implements ``serving.contract.embedding_client.EmbeddingClient`` over an embedding engine.

    Args:
      engine: the embedding engine (used by this loop's thread only).
      max_waiting: the most inputs that may wait; beyond, :meth:`embed` raises
        ``EngineOverloadedError`` (503 at the gateway).
    """

    def __init__(self, engine: EmbeddingEngine, max_waiting: int = 4096):
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: dict[str, collections.deque[_Request]] = {"default": collections.deque(),
                                                                "batch": collections.deque()}
        self._waiting_inputs = 0  # across threads: updated under the lock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = False
        self._stop = False
        self._running = 0

    # ---------------------------------------------------------- EmbeddingClient

    @property
    def max_model_len(self) -> int:
        return self.engine.max_len

    @property
    def kv_capacity_tokens(self) -> None:
        return None

    @property
    def embedding_dim(self) -> int:
        return self.engine.dim

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def is_ready(self) -> bool:
        return self._ready and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = sum(len(q) for q in self._waiting.values())
        return EngineStats(num_running=self._running, num_waiting=waiting + self._inbox.qsize())

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """The checks :meth:`embed` makes before queueing (the gateway runs them first, per
        input, to name the one at fault).

        Raises:
          RequestRejectedError: see :meth:`embed`.
        """
        if not inputs:
            raise RequestRejectedError("no inputs to embed")
        for i, ids in enumerate(inputs):
            if len(ids) == 0:
                raise RequestRejectedError(f"input {i} is empty")
            if len(ids) > self.max_model_len:
                raise RequestRejectedError(f"input {i} has {len(ids)} tokens; this model takes at most "
                                           f"{self.max_model_len}")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestRejectedError(f"input {i} has token id {bad}, outside the vocabulary "
                                           f"(0..{self.vocab_size - 1})")

    async def embed(self, inputs: Sequence[Sequence[int]], priority: str = "default") -> np.ndarray:
        """See ``EmbeddingClient.embed``."""
        return await self._submit(inputs, None, priority)

    async def score(self, inputs: Sequence[Sequence[int]], type_starts: Sequence[int],
                    priority: str = "default") -> np.ndarray:
        """See ``ScoringClient.score``: [len(inputs)] float32 scores of a reranker's engine."""
        if len(type_starts) != len(inputs):
            raise RequestRejectedError(f"{len(inputs)} inputs but {len(type_starts)} type starts")
        return (await self._submit(inputs, [int(t) for t in type_starts], priority))[:, 0]

    async def _submit(self, inputs: Sequence[Sequence[int]], type_starts: list[int] | None,
                      priority: str) -> np.ndarray:
        self.check(inputs)
        if priority not in self._waiting:
            raise RequestRejectedError(f"unknown priority {priority!r}")
        with self._lock:
            if self._waiting_inputs + len(inputs) > self.max_waiting:
                raise EngineOverloadedError(f"{self._waiting_inputs} inputs are waiting to be embedded")
            self._waiting_inputs += len(inputs)
        loop = asyncio.get_running_loop()
        req = _Request([list(map(int, ids)) for ids in inputs], type_starts, priority, loop.create_future(), loop,
                       np.empty((len(inputs), self.embedding_dim), np.float32))
        self._inbox.put(req)
        return await req.future

    # ---------------------------------------------------------- the thread

    def start(self, warmup: bool = True) -> None:
        """Starts the loop's thread (after compiling the smallest shapes with ``warmup``)."""
        if warmup:
            self.engine.warmup()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="embedding-loop", daemon=True)
        self._thread.start()
        self._ready = True

    def stop(self) -> None:
        """Stops the thread; waiting requests fail with RuntimeError."""
        self._stop = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._ready = False
        for q in self._waiting.values():
            while q:
                self._fail(q.popleft(), RuntimeError("the embedding engine stopped"))

    def _run(self) -> None:
        while not self._stop:
            self._take_in(block=not any(self._waiting.values()))
            if self._stop:
                break
            try:
                self._step()
            except Exception:  # a bug in planning: logged, the loop goes on
                log.exception("embedding loop step failed")

    def _take_in(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while True:
            if item is not None:
                with self._lock:
                    self._waiting[item.priority].append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        """One engine step over the oldest waiting inputs (default priority first)."""
        q = self._waiting["default"] or self._waiting["batch"]
        if not q:
            return
        rows: list[tuple[_Request, int]] = []
        longest = 0
        for req in q:
            while req.next_input < len(req.inputs):
                n = len(req.inputs[req.next_input])
                if len(rows) + 1 > self.engine.rows_per_step(max(longest, n)):
                    break
                longest = max(longest, n)
                rows.append((req, req.next_input))
                req.next_input += 1
            if req.next_input < len(req.inputs):
                break
        in_step = {id(r): r for r, _ in rows}
        self._running = len(in_step)
        for req in in_step.values():
            req.steps += 1
        try:
            batch = [r.inputs[i] for r, i in rows]
            if any(r.type_starts is not None for r, _ in rows):  # a cross-encoder's pairs
                starts = [len(r.inputs[i]) if r.type_starts is None else r.type_starts[i] for r, i in rows]
                out = self.engine.embed(batch, type_starts=starts)
            else:
                out = self.engine.embed(batch)
        except Exception as e:
            log.exception("embedding step of %d inputs failed", len(rows))
            for req in {id(r): r for r, _ in rows}.values():
                self._fail(req, RuntimeError(f"embedding failed: {e}"))
        else:
            for (req, i), vec in zip(rows, out):
                req.out[i] = vec
                req.done_inputs += 1
        finally:
            self._running = 0
        with self._lock:
            self._waiting_inputs -= len(rows)
        for name, waiting in self._waiting.items():
            while waiting and (waiting[0].failed or waiting[0].done_inputs == len(waiting[0].inputs)):
                req = waiting.popleft()
                with self._lock:
                    self._waiting_inputs -= len(req.inputs) - req.next_input
                if not req.failed:
                    log.info("%d inputs done in %d steps", len(req.inputs), req.steps)
                    req.loop.call_soon_threadsafe(_resolve, req.future, req.out)

    def _fail(self, req: _Request, error: Exception) -> None:
        req.failed = True
        req.loop.call_soon_threadsafe(_reject, req.future, error)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
