"""The served LoRA adapters: names, a host LRU of read adapters, and the device slots.

Three tiers, as vLLM's ``--max-loras`` / ``--max-cpu-loras``:

  * **names**: every adapter the server serves, ``name -> folder`` (``--lora-modules``,
    ``POST /v1/load_lora_adapter``); an adapter is read and checked when it is added,
    so a bad folder is refused at once (``model.lora_adapter.LoraAdapterError``);
  * **host**: at most ``max_cpu_loras`` read adapters kept in host memory, least
    recently used dropped first (read again from their folder when next needed);
  * **device**: ``max_loras`` slots of the engine's stacked buffers (slot 0 is the
    base model). :meth:`acquire` gives a request its adapter's slot, writing the
    adapter into the least recently used free slot when it is not resident (outside
    any step: ``Engine.write_lora_slot``); the slot is pinned until every request
    holding it calls :meth:`release`, so an adapter is never swapped out, nor its
    name removed (:meth:`remove` raises :class:`LoraInUseError`), under a running
    request. When every slot is pinned by other adapters, :meth:`acquire` returns
    None and the request waits.

Slots are keyed by the adapter's digest (its weights and config), not its name: a
name removed and added again with other weights gets a new digest, so neither its
slot nor (through the prefix-cache salt, ``serving.core.kv.kv_cache_manager.lora_salt``)
its cached KV pages are reused. Not thread-safe: the engine loop's thread calls it
(:meth:`names` alone may be read from any thread: a snapshot replaced, never mutated).
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

from model.lora_adapter import LoraAdapter, read_peft_adapter
from serving.contract.engine_client import LoraInUseError

__all__ = ["LoraGrant", "LoraInUseError", "LoraRegistry"]


@dataclasses.dataclass(frozen=True)
class LoraGrant:
    """What a request holds while it runs: its adapter's device ``slot`` and ``digest``."""

    name: str
    slot: int
    digest: str


class LoraRegistry:
    """Adapters by name, with the host LRU and the device slots (see the module docstring).

    Args:
      engine: the engine whose stacks hold the slots (``write_lora_slot``, ``cfg.max_loras``,
        ``cfg.max_lora_rank``, ``model_cfg``).
      max_cpu_loras: read adapters kept in host memory (at least ``max_loras``).
    """

    def __init__(self, engine, max_cpu_loras: int | None = None):
        self.engine = engine
        self.max_loras = engine.cfg.max_loras
        self.max_cpu_loras = max(max_cpu_loras or self.max_loras, self.max_loras, 1)
        self._paths: dict[str, Path] = {}
        self._names: tuple[str, ...] = ()  # the keys of _paths, replaced whole on every change
        self._digests: dict[str, str] = {}  # name -> digest of what was read when it was added
        self._host: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()  # by name, LRU first
        self._slot_digest: list[str | None] = [None] * (self.max_loras + 1)  # slot 0: the base model
        self._pins = [0] * (self.max_loras + 1)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict(
            (s, None) for s in range(1, self.max_loras + 1))  # least recently used slot first
        self.loads = 0  # adapters written into device slots (for tests and metrics)

    # -- names ----------------------------------------------------------------------

    def names(self) -> tuple[str, ...]:
        """The served names (any thread)."""
        return self._names

    def digest(self, name: str) -> str | None:
        return self._digests.get(name)

    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Serves the adapter in folder ``path`` as ``name`` (read and checked now).

        Raises:
          ValueError: no LoRA on this engine, or ``name`` already served.
          model.lora_adapter.LoraAdapterError: the folder cannot be served (says why).
        """
        if self.max_loras < 1:
            raise ValueError("this server was started without LoRA (--max-loras 0)")
        if name in self._paths:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = self._read(Path(path))
        self._paths[name] = Path(path)
        self._digests[name] = adapter.digest
        self._names = tuple(self._paths)
        self._keep(name, adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Stops serving ``name``; its device slot (unless another name has the same weights) is freed.

        Raises:
          KeyError: not served. LoraInUseError: a request holds its slot.
        """
        if name not in self._paths:
            raise KeyError(name)
        digest = self._digests[name]
        slot = self._slot_of(digest)
        if slot is not None and self._pins[slot] > 0:
            raise LoraInUseError(f"LoRA adapter {name!r} is in use by {self._pins[slot]} request(s)")
        del self._paths[name], self._digests[name]
        self._names = tuple(self._paths)
        self._host.pop(name, None)
        if slot is not None and digest not in self._digests.values():
            self._slot_digest[slot] = None
            self._lru.move_to_end(slot, last=False)  # free: reused first

    # -- device slots ------------------------------------------------------------------

    def acquire(self, name: str) -> LoraGrant | None:
        """Pins ``name``'s device slot for one request, writing the adapter into a slot if it
        is not resident; None when every slot is pinned by other adapters (retry later).

        Raises:
          KeyError: ``name`` is not served.
          model.lora_adapter.LoraAdapterError: its folder no longer reads as it did.
        """
        digest = self._digests[name]
        slot = self._slot_of(digest)
        if slot is None:
            slot = next((s for s in self._lru if self._pins[s] == 0), None)
            if slot is None:
                return None
            adapter = self._host_adapter(name)
            self.engine.write_lora_slot(slot, adapter)
            self._slot_digest[slot] = digest
            self.loads += 1
        self._pins[slot] += 1
        self._lru.move_to_end(slot)
        return LoraGrant(name, slot, digest)

    def release(self, grant: LoraGrant) -> None:
        """Unpins a slot :meth:`acquire` gave (once per grant)."""
        if self._pins[grant.slot] <= 0:
            raise RuntimeError(f"LoRA slot {grant.slot} released more often than acquired")
        self._pins[grant.slot] -= 1

    def in_use(self, name: str) -> int:
        """Requests holding ``name``'s slot."""
        slot = self._slot_of(self._digests.get(name))
        return 0 if slot is None else self._pins[slot]

    # -- internals ---------------------------------------------------------------------

    def _slot_of(self, digest: str | None) -> int | None:
        if digest is None:
            return None
        return next((s for s in range(1, self.max_loras + 1) if self._slot_digest[s] == digest), None)

    def _read(self, path: Path) -> LoraAdapter:
        cfg = self.engine.cfg
        return read_peft_adapter(path, self.engine.model_cfg, max_rank=cfg.max_lora_rank)

    def _keep(self, name: str, adapter: LoraAdapter) -> None:
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_adapter(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # dropped from the host LRU: read again, and it must be what was added
            adapter = self._read(self._paths[name])
            if adapter.digest != self._digests[name]:
                from model.lora_adapter import LoraAdapterError

                raise LoraAdapterError(f"LoRA adapter {name!r}: {self._paths[name]} changed since it was "
                                       "loaded; unload and load it again")
        self._keep(name, adapter)
        return adapter
