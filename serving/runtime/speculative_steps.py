"""The engine loop's side of speculative decoding: dispatching verify steps and reading them back.

The scheduler plans verify rows (``StepPlan.verify``: decode rows with n-gram
drafts, ``serving.core.sched.speculative``) only from tokens the host has read back, so
the engine loop (``serving.runtime.engine_loop``) reads back before planning while a
step may speculate, and always before planning after a verify step (its
request's computed count is settled only at read-back). Steps that cannot
speculate (more than ``max_batch`` requests running, or no request that may)
stay pipelined as before.

Read-back of a verify row (:func:`process_verify`): its emitted tokens are the
sampled tokens up to and including the first that differs from its draft (the
device counted the accepted drafts); they go through the scheduler one by one
(``on_token`` for the first, ``on_accepted`` after it), so a stop token or
``max_tokens`` cuts them exactly where plain decoding would have ended, and
reach the request's consumer as one event.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from serving.core.sched.sched_request import Status
from serving.core.sched.step_plan import StepPlan
from serving.engine.sample.logprobs import HostLogprobs
from serving.engine.verify_step import VerifyOutput

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SpecCounters:
    """Lifetime speculative-decoding counts of one engine loop (see ``EngineStats``)."""

    verify_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def count_row(self, drafts: int, accepted: int) -> None:
        """Counts one verify row with ``drafts`` drafts of which the first ``accepted`` were accepted."""
        self.verify_rows += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        if len(self.drafted_per_position) < drafts:
            grow = drafts - len(self.drafted_per_position)
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(drafts):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < accepted


def dispatch_verify(loop, plan: StepPlan) -> tuple[VerifyOutput, list] | None:
    """Dispatches the plan's verify rows as one step; a failed dispatch fails those
    requests, not the loop.

    Returns:
      None when the plan has no verify rows, else the pending step: the
      :class:`~serving.engine.verify_step.VerifyOutput` (device arrays) and, per row, (its
      sequence, the index of its first token in the step, the plan row).
    """
    if not plan.verify:
        return None
    seqs = [loop._by_id[row.request_id] for row in plan.verify]
    try:
        out = loop.engine.verify(plan.verify, loop.scheduler.speculative_tokens_now())
    except Exception as e:
        log.exception("verify step failed")
        for seq in seqs:
            loop._finish(seq, "error", f"verify failed: {e}")
        return None
    offsets = np.cumsum([0] + [1 + len(row.draft_ids) for row in plan.verify])
    return out, [(seq, int(offsets[i]), row) for i, (seq, row) in enumerate(zip(seqs, plan.verify))]


def process_verify(loop, out: VerifyOutput, owners: list, counters: SpecCounters) -> None:
    """Reads back a verify step: streams each row's emitted tokens (see the module docstring)."""

    try:
        tokens = np.asarray(out.sampled.tokens)
        accepted = np.asarray(out.accepted)
        wanted = any(seq.sched.sampling.logprobs >= 0 for seq, _, _ in owners)
        lp = HostLogprobs(out.sampled) if wanted else None
    except Exception as e:
        log.exception("verify step failed")
        for seq, _, _ in owners:
            loop._finish(seq, "error", f"step failed: {e}")
        return
    sched = loop.scheduler
    for i, (seq, offset, row) in enumerate(owners):
        if seq.sched.status is Status.FINISHED:
            continue  # finished or cancelled while the step was in flight
        a = int(accepted[i])
        if row.draft_ids:
            counters.count_row(len(row.draft_ids), a)
            seq.sched.num_accepted_tokens += a
        k = seq.sched.sampling.logprobs
        ids, entries, reason = [], [], None
        for j in range(a + 1):
            tok = int(tokens[offset + j])
            reason = sched.on_token(seq.sched, tok) if j == 0 else sched.on_accepted(seq.sched, tok)
            ids.append(tok)
            if k >= 0:
                entries.append(lp.entry(offset + j, tok, k))
            if reason is not None:
                break
        logprobs = tuple(entries) if k >= 0 else None
        if reason is None:
            loop._emit(seq, tuple(ids), logprobs=logprobs)
        else:
            loop._finish(seq, reason, ids=tuple(ids), logprobs=logprobs)
