"""The engine loop's prefill and decode steps: dispatching a plan's rows, reading back their tokens.

Functions of :class:`serving.runtime.engine_loop.EngineLoop` (``loop``) run on its
thread: ``dispatch_prefill`` / ``dispatch_decode`` hand the plan's rows to the
engine (with the structured-output mask, and a prefill's images) and return what
``process_step`` needs a turn later, when it reads the sampled tokens back
(timed into the loop's ``TurnProfile``: the wait, then the per-token host work),
streams them with their log probabilities, and ends the requests that stop.
A failed step fails its own requests, never the loop. Verify steps of
speculative decoding are read back by ``serving.runtime.speculative_steps``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from serving.core.sched.sched_request import Status
from serving.core.sched.step_plan import StepPlan
from serving.engine.sample.logprobs import HostLogprobs, PromptLogprobs
from serving.engine.verify_step import VerifyOutput
from serving.runtime.speculative_steps import process_verify

log = logging.getLogger("serving.runtime.engine_loop")


def dispatch_prefill(loop, plan: StepPlan, failed: list):
    """Dispatches the plan's prefill rows; returns (output, [(seq, i)] for rows that sample,
    [(seq, first token's index, row)] for rows whose prompt tokens are scored)."""
    if not plan.prefill:
        return None
    seqs = [loop._by_id[row.request_id] for row in plan.prefill]
    try:
        mask = loop._token_mask(seqs, [row.samples for row in plan.prefill], failed)
        images = {seq.req.request_id: seq.req.images for seq in seqs if seq.req.images}
        kwargs = {"images": images} if images else {}
        out = (loop.engine.prefill(plan.prefill, **kwargs) if mask is None
               else loop.engine.prefill(plan.prefill, token_mask=mask, **kwargs))
    except Exception as e:  # a failed step fails its requests, not the server
        log.exception("prefill step failed")
        for seq in seqs:
            loop._finish(seq, "error", f"prefill failed: {e}")
        return None
    offsets = np.cumsum([0] + [len(row.token_ids) for row in plan.prefill])
    scored = [(seq, int(offsets[i]), row) for i, (row, seq) in enumerate(zip(plan.prefill, seqs))
              if row.wants_prompt_logprobs]
    return out, [(seq, i) for i, (row, seq) in enumerate(zip(plan.prefill, seqs)) if row.samples], scored

def dispatch_decode(loop, plan: StepPlan, failed: list):
    """Dispatches one decode step over the plan's decode rows.

    A request whose prompt finished in this turn's prefill decodes next
    turn; its first token is already on device in its slot.
    """
    if not plan.decode:
        return None
    seqs = [loop._by_id[row.request_id] for row in plan.decode]
    try:
        mask = loop._token_mask(seqs, [True] * len(seqs), failed)
        out = (loop.engine.decode(plan.decode) if mask is None
               else loop.engine.decode(plan.decode, token_mask=mask))
    except Exception as e:
        log.exception("decode step failed")
        for seq in seqs:
            loop._finish(seq, "error", f"decode failed: {e}")
        return None
    return out, [(seq, i) for i, seq in enumerate(seqs)]

def process_step(loop, out, owners: list, scored=()) -> None:
    """Reads back one step's output: streams its tokens (with log probabilities where
    asked) and collects its scored prompt tokens."""
    if isinstance(out, VerifyOutput):
        return process_verify(loop, out, owners, loop.spec_counters)
    try:
        prompt_out = None
        if isinstance(out, tuple):
            out, prompt_out = out
        t = time.perf_counter()
        tokens = np.asarray(out.tokens)
        t_host = time.perf_counter()
        loop.profile.add("readback_wait", t_host - t)
        wanted = [seq.sched.sampling.logprobs >= 0 for seq, _ in owners]
        lp = HostLogprobs(out) if any(wanted) else None
        if scored:
            collect_prompt_logprobs(prompt_out, scored)
    except Exception as e:
        log.exception("step failed")
        for seq in [seq for seq, _ in owners] + [seq for seq, _, _ in scored]:
            loop._finish(seq, "error", f"step failed: {e}")
        return
    now = time.time()
    for seq, i in owners:
        if seq.sched.status is Status.FINISHED:
            continue  # finished or cancelled while this step was in flight
        tok = int(tokens[i])
        if seq.req.sampling.max_tokens == 0:  # prompt scoring only: no token
            loop._finish(seq, "length")
            continue
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.armed_by is not None:
            seq.armed_by = None if tok == seq.armed_by else seq.armed_by  # the thinking ended
        elif seq.matcher is not None and not seq.matcher.consume_token(tok):
            loop._finish(seq, "error", f"structured output failed at token {tok}: "
                                       f"{seq.matcher.get_error()}")
            continue
        k = seq.sched.sampling.logprobs
        entry = (lp.entry(i, tok, k),) if k >= 0 else None
        reason = loop.scheduler.on_token(seq.sched, tok)
        if reason is None:
            loop._emit(seq, (tok,), logprobs=entry)
        else:
            loop._finish(seq, reason, ids=(tok,), logprobs=entry)
    loop.profile.add("readback_host", time.perf_counter() - t_host)

def collect_prompt_logprobs(prompt_out: PromptLogprobs, scored) -> None:
    """Stores each scored row's entries at the positions of the tokens they score."""
    host = HostLogprobs(prompt_out)
    for seq, offset, row in scored:
        if seq.sched.status is Status.FINISHED or seq.first_event_sent:
            continue
        k = seq.sched.sampling.prompt_logprobs
        prompt = seq.sched.prompt_ids
        for j in range(min(row.end, row.prompt_len - 1) - row.start):
            pos = row.start + j + 1  # the token scored by the logits at position pos - 1
            seq.prompt_logprobs[pos] = host.entry(offset + j, prompt[pos], k)

