"""A request's scheduling state (:class:`SchedRequest`), its status, and the priority classes.

The scheduler (``serving.core.sched.scheduler``) moves a request's computed tokens towards
its known ones and holds its slot; the request's pages are the KV-cache manager's, by
request id. Priority classes: see the scheduler's module docstring.
"""

from __future__ import annotations

import dataclasses
import enum

from serving.core.sched.step_plan import GREEDY, SamplingSettings

PRIORITY, INTERACTIVE, BATCH = 0, 1, 2
PRIORITIES = {"priority": PRIORITY, "default": INTERACTIVE, "interactive": INTERACTIVE,
              "flex": BATCH, "batch": BATCH}
"""Scheduling class of each ``EngineRequest.priority`` name: the service tiers
("priority", "default", "flex") and the older "interactive" (= default) and "batch" (= flex)."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class SchedRequest:
    """One request's scheduling state (its pages are the KV-cache manager's, by ``request_id``).

    Attributes:
      request_id: unique among live requests (names its pages in the manager).
      prompt_ids: prompt token ids.
      max_tokens: most tokens to generate.
      stop_token_ids: a generated token in here finishes the request ("stop").
      priority: PRIORITY (0), INTERACTIVE (1) or BATCH (2); lower runs first and is
        preempted last (see the module docstring).
      salt: prefix-cache scope (tenant); None shares with every other None.
      sampling: sampling settings, opaque to the scheduler (copied into plan rows).
      output_ids: generated tokens read back so far.
      num_inflight: generated tokens sampled on device, not yet read back.
      num_computed: tokens whose K/V are in (or being written to) the cache.
      cached_tokens: prompt tokens served from the prefix cache at first admission
        (host-tier pages included).
      host_cached_tokens: tokens reloaded from the host tier instead of computed, summed
        over its admissions (a preempted request's resumption too).
      slot: the engine slot while running.
      token_on_device: the last known token was sampled on device and sits in
        the slot (so a decode row can feed it). False after admission: a
        recomputed request's tokens all come from the host.
      num_preemptions: times it was preempted.
      prefix_cache: False: never take prefix-cache hits, every token is computed
        in the request's slot (prompt log probabilities and the penalties' token
        counts need that), nor is it forked from its parent (``parent_id``); its
        full pages are still offered to the cache.
      parent_id: the family root this request was forked from or waits for
        (see the module docstring); None for an ordinary request.
      speculate: False: never verified with drafts (structured output: each
        position's mask needs the tokens before it consumed on the host).
      max_drafts: the most drafts per step for it (its ``num_speculative_tokens``; None:
        the server's K).
      num_draft_tokens, num_accepted_tokens: drafts verified for it and accepted.
      queued_at: the scheduler's clock (seconds) when it was added.
      protected: a BATCH request the starvation guard promoted to INTERACTIVE.
      images: its prompt's images as (start, end, digest) (Gemma 3 vision): a prompt
        chunk never ends inside one (its tokens attend to each other, so they are
        computed in one step: :meth:`Scheduler._fit_images`), and the digests are hashed
        into the prefix-cache pages that hold their tokens.
      lora_slot: the device slot of its LoRA adapter, copied into its plan rows (0: none).
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    priority: int = INTERACTIVE
    salt: str | None = None
    sampling: SamplingSettings = GREEDY
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_inflight: int = 0
    num_computed: int = 0
    cached_tokens: int | None = None
    host_cached_tokens: int = 0
    slot: int | None = None
    token_on_device: bool = False
    status: Status = Status.WAITING
    arrival: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    prefix_cache: bool = True
    parent_id: str | None = None
    speculate: bool = True
    max_drafts: int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    queued_at: float = 0.0
    protected: bool = False
    images: tuple[tuple[int, int, str], ...] = ()
    lora_slot: int = 0

    @property
    def num_tokens(self) -> int:
        """Known tokens, counting in-flight ones whose ids the host has not seen yet."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_inflight

    def token_ids(self) -> list[int]:
        """Host-known token ids (prompt + read-back outputs)."""
        return self.prompt_ids + self.output_ids
