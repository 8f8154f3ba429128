"""The engine loop's side of LoRA serving: a request's adapter slot, and loading at run time.

A request naming an adapter (``EngineRequest.lora_name``) is queued in the scheduler
only once its adapter holds a device slot (``serving.engine.lora_registry``): the slot
goes into its plan rows (``SchedRequest.lora_slot``), its prefix-cache salt is joined
with the adapter's digest (``serving.core.kv.kv_cache_manager.lora_salt``: no KV page is
shared across adapters, nor with other weights loaded later under the same name), and
it is never verified with drafts (the verify step runs the base model). While every
slot is pinned by other adapters' requests it waits here, in arrival order, and is
queued when a slot frees; the slot is released when the request ends, however it ends.

Loading and unloading at run time (``POST /v1/load_lora_adapter``, ``unload``) run on
the loop thread between steps (:meth:`LoraAdmission.control`), so no step sees a slot
change under it, and an adapter that a waiting or running request holds is not
unloaded (``serving.engine.lora_registry.LoraInUseError``).
"""

from __future__ import annotations

import collections
import logging

from serving.contract.engine_client import LoraInUseError
from serving.core.kv.kv_cache_manager import lora_salt
from serving.engine.lora_registry import LoraRegistry

log = logging.getLogger(__name__)


class LoraAdmission:
    """Requests' adapter slots over a :class:`LoraRegistry` (loop thread only).

    Args:
      registry: the served adapters.
      queue: ``queue(seq)`` hands a request whose adapter holds a slot to the scheduler.
      fail: ``fail(seq, message)`` ends a request with an error.
    """

    def __init__(self, registry: LoraRegistry, queue, fail):
        self.registry = registry
        self._queue = queue
        self._fail = fail
        self.waiting: collections.deque = collections.deque()  # requests waiting for a slot

    def names(self) -> list[str]:
        return self.registry.names()

    def admit(self, seq) -> None:
        """Queues ``seq`` (its adapter in ``seq.req.lora_name``) now, or once a slot frees."""
        if self.waiting or not self._try(seq):
            self.waiting.append(seq)

    def retry(self) -> None:
        """Queues the waiting requests whose adapters now get a slot, in arrival order."""
        while self.waiting:
            seq = self.waiting.popleft()
            if not self._try(seq):
                self.waiting.appendleft(seq)
                return

    def drop(self, seq) -> bool:
        """Forgets a request that ends while waiting; whether it was waiting."""
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        return True

    def release(self, seq) -> None:
        """Unpins the slot of a request that ends (no-op without one)."""
        grant, seq.lora = seq.lora, None
        if grant is not None:
            self.registry.release(grant)

    def control(self, op: str, name: str, path: str | None):
        """Runs "load" (``path``) or "unload" on the registry; returns what it returns, raises
        what it raises (``ValueError``, ``KeyError``, ``LoraAdapterError``, ``LoraInUseError``)."""
        if op == "load":
            self.registry.add(name, path)
            return None
        if any(s.req.lora_name == name for s in self.waiting):
            raise LoraInUseError(f"LoRA adapter {name!r} has requests waiting for a slot")
        self.registry.remove(name)
        self.retry()
        return None

    def _try(self, seq) -> bool:
        """Pins the slot and queues ``seq``; False: no slot free now. An adapter unloaded
        or unreadable since the request was submitted ends the request with an error."""
        try:
            grant = self.registry.acquire(seq.req.lora_name)
        except (KeyError, ValueError) as e:  # unloaded; LoraAdapterError: its folder changed
            why = f"LoRA adapter {seq.req.lora_name!r} was unloaded" if isinstance(e, KeyError) else str(e)
            self.waiting.append(seq)  # never queued: the loop's fail() drops it from here
            self._fail(seq, why)
            return True
        if grant is None:
            return False
        seq.lora = grant
        seq.sched.lora_slot = grant.slot
        seq.sched.salt = lora_salt(seq.sched.salt, grant.digest)
        seq.sched.speculate = False
        self._queue(seq)
        return True
