"""The scheduler: which requests run each step, within a token budget, over shared pages.

Plain Python over token counts and request ids (no JAX), after vLLM v1's
scheduler: a request has no "prefill phase". It has *known* tokens (prompt
plus generated) and *computed* tokens (whose K/V are in the cache), and each
step moves computed towards known::

    known:     | prompt .................. | out0 out1 out2 |
    computed:  | cached prefix | chunk ... |                       prefill / prefix hit
    computed:  | ......................................| out2 |    decode: one token behind

so chunked prefill, prefix-cache hits and recomputation after preemption are
one mechanism. When a step computes a request's last known token, the engine
samples its next token (keyed by (seed, position), so recomputation draws
the same token as the first time).

Pages belong to the :class:`~serving.core.kv.kv_cache_manager.KVCacheManager`, which
holds each request's page list, keys and reference counts by request id; the
scheduler only says how many tokens a request needs pages for, when its
computed pages may be cached, and when it lets go of them.

Each step (:meth:`Scheduler.schedule`): every running request that is one
token behind gets a decode row (one budget token each); then the rest of the
budget goes to prompt chunks: running requests first, then waiting ones in
(priority, arrival) order, admitted while a slot is free and their pages fit
above a small watermark (with every slot taken, a waiting request takes the
slot of the newest running request of a lower priority, which is preempted:
flex work gives way to default work, and both to priority work, at once, not when
it finishes); a
waiting prompt that a later step could take whole is not started in the rest
of this one (:meth:`Scheduler._would_split`), beyond the padding of the step's
shape bucket (``prefill_bucket``: tokens the step computes anyway). When a
running request needs a page and none is free or evictable, the
lowest-priority, newest running request is preempted: its
pages are released (their full pages stay in the prefix cache), and it waits
at the front of its priority class to be recomputed.

Priority classes (``PRIORITIES``: the service tiers and the older names):
PRIORITY (``"priority"``) runs first and takes the slot of default or flex
work; INTERACTIVE (``"default"``, ``"interactive"``) takes the slot of flex
work; BATCH (``"flex"``, ``"batch"``: flex requests and Batch API lines) is
admitted last and preempted first, until the starvation guard
(``serving.core.sched.starvation_guard``) promotes it to INTERACTIVE.

The plan is a :class:`~serving.core.sched.step_plan.StepPlan` of value records, built
while planning, each right after its request's pages are reserved:
  * a ``PrefillRow`` computes tokens [start, start + len(token_ids)), start =
    the request's computed count before the step; it samples (``samples``)
    when it reaches the last known token;
  * a ``DecodeRow``'s ``position`` is its input token's position = the
    request's computed count before the step (its last known token);
  * ``page_ids`` is the request's page-table row at that moment, covering
    every position the row writes. A request's pages only grow while it
    runs, and a preemption later in the same pass drops the victim's rows
    (by request id) and frees only the victim's pages, so the rows left are
    exact.
Planning then commits the plan: computed counts advance, sampled tokens are
in flight, newly full pages are offered to the prefix cache.

Forked choices (``n`` choices of one prompt): a request with a ``parent_id``
(a *child*; the parent and its children are a *family*, all with the same
prompt and salt) is admitted by forking the prompt's K/V from a running family
member (the *source*) instead of computing it::

    parent:  | prompt[0 .. P-2] | prompt[P-1] | out ...       computed by its own prefill
    child:   |  shared / copied | prompt[P-1] | its out ...   one 1-token prefill row
                                  ^ samples the child's first token with its own seed

  * the source is a running family member (the parent first) whose computed
    count reached P - 1 in an earlier step (not admitted in this pass, so
    its pages hold written K/V, and no page is copied from a page that is
    itself a copy destination in the same step). The child takes references
    on its full pages below P - 1 and a copy of the partial one
    (``PrefillRow.page_copy``, run on device before the step's model call,
    so the source may even be preempted later in the same pass); it starts
    at computed = P - 1, so the prompt's other tokens are never computed
    again, and reports them as ``cached_tokens``;
  * while a running family member is still computing the prompt, the child
    waits and keeps a slot: requests behind it in the queue are admitted
    only into the slots beyond those kept, so the choices start together;
    while the parent itself waits, the child waits behind it without a slot;
  * with no running family member and the parent gone (finished,
    cancelled, or never known), the child is admitted as an ordinary request
    (prefix cache and all) and becomes the source for its siblings;
  * a preempted child (or parent) is an ordinary waiting request again: a
    child re-forks if a source exists and the prefix cache holds less of
    it, else it is recomputed (from its prefix-cache hit).

Speculative decoding (``serving.core.sched.speculative``, when the scheduler has a
:class:`~serving.config.speculative_config.SpeculativeConfig`): with R requests running,
K_eff = min(K, speculative token budget // R - 1) (0 above ``max_batch``:
``SpeculativeConfig.tokens_at``, K shrinking as the batch grows), a decode row whose tokens
the host knows (none in flight: the engine loop reads back before such a step) gets up to
K_eff n-gram drafts (with a draft model, placeholder ids that the engine's draft steps
replace on the device), and
pages for them too (taken only when free: a draft never preempts). If any row
of the step has drafts, every row that may speculate goes into the step's
verify rows (``StepPlan.verify``, some with no drafts); the others stay decode
rows. A verify row is committed like a decode row (one token in flight, one
more computed); at read-back :meth:`Scheduler.on_token` takes its first token
and :meth:`Scheduler.on_accepted` each accepted one after it, which also
counts the draft it equals as computed. The K/V written for rejected drafts
lies beyond the computed tokens and is overwritten later.

Generated tokens are "in flight" between dispatch and read-back (the engine
pipelines steps). Preemption needs every token id of its victim, so when it
would be needed while tokens are in flight, :meth:`schedule` asks the caller
to read them back first (``StepPlan.needs_sync``).

Invariants (checked by :meth:`Scheduler.check_invariants` with the manager's):
running requests hold distinct slots and pages covering their computed
tokens; waiting and finished requests hold no slot and no pages; a child's
parent id names a live family root or one that has gone (never another child).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from serving.config.speculative_config import MODEL_METHODS, SpeculativeConfig
from serving.core.kv.kv_cache_manager import KVCacheManager, PageCopy, PrefixHit
from serving.core.sched.sched_request import BATCH, INTERACTIVE, SchedRequest, Status
from serving.core.sched.speculative import may_speculate, propose_ngram
from serving.core.sched.starvation_guard import StarvationGuard
from serving.core.sched.step_plan import DecodeRow, PrefillRow, StepPlan


class Scheduler:
    """Plans engine steps over ``num_slots`` slots and a ``KVCacheManager``.

    Args:
      kv: the page manager (shared with nobody else).
      num_slots: most running requests.
      token_budget: most tokens computed per step (decode rows + prompt chunks).
      max_prefill_tokens: most prompt tokens per step (the engine's prefill chunk).
      max_prefill_seqs: most sequences with a prompt chunk per step.
      watermark_pages: free pages kept back when admitting new requests, so
        running ones can grow without immediately preempting.
      speculative: n-gram speculative decoding settings (None: off).
      starvation_preemptions: a waiting BATCH request preempted more than this many
        times is protected (``starvation_guard.py``); None: never for preemptions.
      starvation_seconds: a BATCH request still waiting this many seconds after it
        was queued is protected; None: never for waiting.
      clock: seconds, monotonic (tests pass their own).
      prefill_bucket: the tokens a prefill step of n prompt tokens computes (the
        engine's token bucket, >= n and <= max_prefill_tokens); None: n (no padding).
      prefill_rows: the rows a prefill step of n rows computes (the engine's row bucket);
        None: a row costs nothing.

    Raises:
      ValueError: token_budget <= num_slots.
    """

    def __init__(self, kv: KVCacheManager, num_slots: int, token_budget: int,
                 max_prefill_tokens: int, max_prefill_seqs: int = 1, watermark_pages: int | None = None,
                 speculative: SpeculativeConfig | None = None, starvation_preemptions: int | None = None,
                 starvation_seconds: float | None = None, clock: Callable[[], float] = time.monotonic,
                 prefill_bucket: Callable[[int], int] | None = None,
                 prefill_rows: Callable[[int], int] | None = None):
        if token_budget < num_slots + 1:
            raise ValueError(f"token_budget ({token_budget}) must exceed num_slots ({num_slots})")
        self.kv = kv
        self.num_slots = num_slots
        self.token_budget = token_budget
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.prefill_bucket = prefill_bucket
        self.prefill_rows = prefill_rows
        self.speculative = speculative
        self.clock = clock
        self.starvation = StarvationGuard(starvation_preemptions, starvation_seconds, clock)
        self.watermark_pages = (max(1, kv.num_pages // 100) if watermark_pages is None
                                else watermark_pages)
        self.waiting: list[SchedRequest] = []
        self.running: list[SchedRequest] = []
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._live: dict[str, SchedRequest] = {}  # waiting and running requests by id
        self._arrivals = itertools.count()
        self._head_waits_for_pages = False  # the last schedule() could not admit the queue's head

    @property
    def num_open_slots(self) -> int:
        """Slots a new request could take at the next step (int): the free slots,
        or 0 while the head of the waiting queue waits for KV pages."""
        return 0 if self._head_waits_for_pages else len(self._free_slots)

    # -- lifecycle ---------------------------------------------------------------

    def pages_needed_alone(self, num_tokens: int) -> int:
        """Pages a request of num_tokens tokens needs with nothing shared."""
        return self.kv.pages_for(num_tokens)

    def add(self, req: SchedRequest) -> None:
        """Queues a new request (validated by the caller to fit the pool alone).

        A ``parent_id`` naming a live request with the same prompt and salt
        makes req a child of that request's family (of its root, if the parent
        is a child itself); otherwise it is cleared and req is ordinary.
        """
        parent = self._live.get(req.parent_id) if req.parent_id is not None else None
        if (parent is None or parent.prompt_ids != req.prompt_ids or parent.salt != req.salt
                or len(req.prompt_ids) < 2):  # a 1-token prompt has nothing to share
            req.parent_id = None
        else:
            req.parent_id = parent.parent_id or parent.request_id  # the family's root
        req.arrival = next(self._arrivals)
        req.queued_at = self.clock()
        req.status = Status.WAITING
        self._live[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: SchedRequest, reason: str) -> None:
        """Ends a request (any state): releases its slot and pages. Idempotent."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._free_slots.append(req.slot)
            req.slot = None
        else:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self._live.pop(req.request_id, None)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def on_token(self, req: SchedRequest, token: int) -> str | None:
        """Records one read-back token. Returns a finish reason ("stop"/"length") or None.

        The caller then calls :meth:`finish`. Tokens of finished requests are ignored.
        """
        if req.status is Status.FINISHED:
            return None
        req.num_inflight -= 1
        req.output_ids.append(token)
        self._cache_full_pages(req)
        return self._finish_reason(req, token)

    def on_accepted(self, req: SchedRequest, token: int) -> str | None:
        """Records a token a verify step accepted after its first one (see the module
        docstring): the draft it equals (the token before it) is computed. Returns a
        finish reason or None, as :meth:`on_token`; call it after that token's."""
        if req.status is Status.FINISHED:
            return None
        req.num_computed += 1
        req.output_ids.append(token)
        self._cache_full_pages(req)
        return self._finish_reason(req, token)

    @staticmethod
    def _finish_reason(req: SchedRequest, token: int) -> str | None:
        if token in req.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_tokens:
            return "length"
        return None

    @property
    def num_inflight(self) -> int:
        return sum(r.num_inflight for r in self.running)

    def speculation_wants_tokens(self) -> bool:
        """Whether the next step may speculate but needs tokens still in flight: the caller
        should read them back before :meth:`schedule` (drafts come from host-known tokens)."""
        spec = self.speculative
        if spec is None or spec.tokens_at(len(self.running)) == 0:
            return False
        return any(r.num_inflight and r.speculate and may_speculate(r.sampling, r.num_generated)
                   for r in self.running)

    def speculative_tokens_now(self) -> int:
        """The most drafts a request may get in the next step at the present load (K_eff,
        ``SpeculativeConfig.tokens_at``: K shrinks as more requests run, within the
        speculative token budget, and is 0 above ``max_batch``: a full batch gains nothing
        from drafts, a verify row costs 1 + K_eff rows of compute); 0 without speculative decoding."""
        spec = self.speculative
        return 0 if spec is None else spec.tokens_at(len(self.running))

    def _drafts(self, req: SchedRequest, budget: int) -> tuple[int, ...]:
        """A decode row's n-gram drafts (() when it cannot speculate now), at most the
        tokens it may still generate minus one and what the budget leaves the other rows."""
        spec = self.speculative
        k = min(self.speculative_tokens_now(), req.max_tokens - req.num_generated - 1, budget - len(self.running),
                spec.num_tokens if req.max_drafts is None else req.max_drafts)
        if k <= 0 or req.num_inflight:
            return ()
        if spec.method in MODEL_METHODS:  # placeholders: the engine's draft model fills them on the device
            return (0,) * k
        return propose_ngram(req.token_ids(), k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    # -- planning ----------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plans one step and commits it (computed counts, in-flight tokens, pages).

        Returns:
          the plan (rows by value; see the module docstring), or an empty plan
          with ``needs_sync`` set when a preemption must wait for in-flight tokens.
        """
        plan = StepPlan()
        budget = self.token_budget
        spec = self.speculative_tokens_now() > 0
        # 1. Decode rows: running requests one (sampled) token behind (verify rows: with drafts).
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted while planning this step
            behind = req.num_tokens - req.num_computed
            if behind != 1 or not req.token_on_device or req.num_generated >= req.max_tokens:
                continue
            verify = (spec and req.speculate and not req.num_inflight
                      and may_speculate(req.sampling, req.num_generated))
            drafts = self._drafts(req, budget) if verify else ()
            if drafts and not self.kv.allocate_pages(req.request_id, req.num_tokens + len(drafts),
                                                     watermark=self.watermark_pages):
                drafts = ()  # no free pages for them: a draft never preempts
            if not self._reserve_pages(req, req.num_tokens, plan):
                if plan.needs_sync:
                    return self._abort(plan)
                continue
            row = DecodeRow(req.request_id, req.slot, req.num_computed, self.kv.page_ids(req.request_id),
                            req.sampling, num_generated=req.num_generated, lora_slot=req.lora_slot)
            if verify:
                known = req.token_ids()
                row = dataclasses.replace(row, last_token=known[-1], draft_ids=drafts,
                                          prev_token=known[-2] if len(known) > 1 else -1)
                plan.verify.append(row)
            else:
                plan.decode.append(row)
            budget -= 1 + len(drafts)
        if not any(r.draft_ids for r in plan.verify):  # nothing to verify: plain decode rows
            plan.decode += plan.verify
            plan.verify = []
        # 2. Prompt / recompute chunks of running requests, then admissions.
        prefill_budget = min(budget, self.max_prefill_tokens)
        for req in list(self.running):
            if len(plan.prefill) >= self.max_prefill_seqs or prefill_budget == 0:
                break
            if req.status is not Status.RUNNING or req.token_on_device:
                continue  # not running any more, or decoding
            n = self._fit_images(req, req.num_computed, min(req.num_tokens - req.num_computed, prefill_budget))
            if n <= 0:
                continue
            if not self._reserve_pages(req, req.num_computed + n, plan):
                if plan.needs_sync:
                    return self._abort(plan)
                continue
            prefill_budget -= self._add_chunk(plan, req, n)
        self.starvation.protect(self.waiting, BATCH, INTERACTIVE)
        self.waiting.sort(key=lambda r: (r.priority, r.arrival))
        self._head_waits_for_pages = False
        kept = 0  # slots kept for children ahead in the queue waiting for a running family member
        admitted: set[str] = set()  # admitted in this pass: not fork sources before the next
        for req in list(self.waiting):
            if prefill_budget == 0 or len(plan.prefill) >= self.max_prefill_seqs:
                break
            no_slot = len(self._free_slots) <= kept
            victim = self._lower_priority_victim(req) if no_slot else None  # whose slot it takes
            if no_slot and victim is None:
                break
            source = None
            if req.parent_id is not None and req.prefix_cache:  # (else computed alone)
                source, family_runs = self._fork_source(req, admitted)
                if source is None and (family_runs or req.parent_id in self._live):
                    kept += family_runs
                    continue  # waits for its family's prompt (see the module docstring)
            hit = self._prefix_hit(req)
            room = prefill_budget
            if plan.prefill and self._would_split(req, source, hit, prefill_budget):
                room = self._padding(plan, prefill_budget)
                if room == 0:
                    break  # it starts whole in the next step (see _would_split); the queue waits behind it
            start = self._admission_start(req, hit, source)
            if self._fit_images(req, start, min(req.num_tokens - start, room)) <= 0:
                break  # an image does not fit in what this step has left: the next step's budget
            if victim is not None:  # no free slot: take the victim's
                if victim.num_inflight:
                    plan.needs_sync = True
                    return self._abort(plan)
                self._preempt(victim, plan)
            copies = self._admit(req, room, hit, source)
            if copies is None:
                self._head_waits_for_pages = True
                break  # head of line waits (lower priorities wait behind it)
            admitted.add(req.request_id)
            n = self._fit_images(req, req.num_computed, min(req.num_tokens - req.num_computed, room))
            prefill_budget -= self._add_chunk(plan, req, n, copies[0] if copies else None)
        assert plan.num_tokens <= self.token_budget
        return self._commit(plan)

    @staticmethod
    def _fit_images(req: SchedRequest, start: int, n: int) -> int:
        """The chunk length at most ``n`` from ``start`` that ends outside every image of
        ``req`` (cut back to the start of the image it would end inside); 0 when the chunk
        would end inside an image that began at or before ``start`` (it waits for a step
        with room for the whole image; the engine refuses images longer than a chunk)."""
        end = start + n
        for s, e, _ in req.images:
            if s < end < e:
                return s - start if s > start else 0
        return n

    def _abort(self, plan: StepPlan) -> StepPlan:
        """Plans nothing this time. Pages reserved so far stay with their requests
        (each will need them for its next tokens anyway); preemptions stand."""
        return StepPlan(preempted=plan.preempted, needs_sync=True)

    def _add_chunk(self, plan: StepPlan, req: SchedRequest, n: int, page_copy: PageCopy | None = None) -> int:
        """Appends the row for req's next n tokens (its pages already cover them); returns n."""
        start = req.num_computed
        tokens = req.token_ids()[start:start + n]
        prompt_len = len(req.prompt_ids)
        plan.prefill.append(PrefillRow(req.request_id, req.slot, start, tuple(tokens),
                                       self.kv.page_ids(req.request_id),
                                       samples=start + n == req.num_tokens, sampling=req.sampling,
                                       prompt_len=prompt_len, num_generated=req.num_generated,
                                       next_prompt_id=req.prompt_ids[start + n] if start + n < prompt_len else -1,
                                       page_copy=page_copy, lora_slot=req.lora_slot))
        return n

    def _commit(self, plan: StepPlan) -> StepPlan:
        """Applies a finished plan: computed counts, in-flight tokens, newly cacheable pages."""
        by_id = {r.request_id: r for r in self.running}  # every planned row's request runs
        for row in plan.decode + plan.verify:  # a verify row's accepted drafts count at read-back
            req = by_id[row.request_id]
            req.num_computed += 1
            req.num_inflight += 1
            req.num_draft_tokens += len(row.draft_ids)
        for row in plan.prefill:
            req = by_id[row.request_id]
            req.num_computed += len(row.token_ids)
            if row.samples:
                req.num_inflight += 1
                req.token_on_device = True
            self._cache_full_pages(req)
        return plan

    def _fork_source(self, req: SchedRequest, admitted: set[str]) -> tuple[SchedRequest | None, bool]:
        """A child's fork source (the root first) and whether any family member runs."""
        family = [r for r in self.running if (r.request_id == req.parent_id or r.parent_id == req.parent_id)
                  and r.prompt_ids == req.prompt_ids and r.salt == req.salt]
        # Not one admitted in this pass: its pages may be a copy destination of this very step.
        ready = [r for r in family
                 if r.request_id not in admitted and r.num_computed >= len(req.prompt_ids) - 1]
        source = next((r for r in ready if r.parent_id is None), ready[0] if ready else None)
        return source, bool(family)

    def _prefix_hit(self, req: SchedRequest) -> PrefixHit:
        """Waiting ``req``'s prefix-cache hit (pure: takes no references). A full hit still
        recomputes the last token, to get its logits."""
        tokens = req.token_ids()
        return self.kv.lookup_prefix(tokens, req.salt, max_tokens=len(tokens) - 1 if req.prefix_cache else 0,
                                     images=req.images)

    @staticmethod
    def _admission_start(req: SchedRequest, hit: PrefixHit, source: SchedRequest | None) -> int:
        """The first position waiting ``req`` computes: after its hit, or forked from
        ``source``'s prompt at the last prompt token (computed again, for its logits) when
        the hit does not reach that far (a preempted child's own cached pages may)."""
        if source is not None and hit.num_tokens < len(req.prompt_ids) - 1:
            return len(req.prompt_ids) - 1
        return hit.num_tokens

    def _would_split(self, req: SchedRequest, source: SchedRequest | None, hit: PrefixHit,
                     budget: int) -> bool:
        """Whether admitting waiting ``req`` now would start a prompt that one later step
        could take whole: its uncached tokens exceed what this step has left (``budget``)
        but not ``max_prefill_tokens``. Such a prompt waits for the next step instead of
        filling this one with its first chunk: the chunk would make this step's prompts
        (and the decode rows) wait for it, and the prompt's first token still comes only
        after its last chunk, one step later either way. (Several ~400-token prompts
        arriving at once, in 512-token steps: the first prompt's TTFT paid for a chunk of
        the second, and every later one for a chunk of the next; benchmarks/RESULTS.md.)
        A prompt longer than ``max_prefill_tokens`` is chunked anyway and starts now."""
        remaining = req.num_tokens - self._admission_start(req, hit, source)
        return budget < remaining <= self.max_prefill_tokens

    def _padding(self, plan: StepPlan, budget: int) -> int:
        """The prompt tokens ``plan``'s prefill step could still take at no cost (at most
        ``budget``): its shape bucket's padding, which the engine computes anyway. A waiting
        prompt that :meth:`_would_split` holds back starts in it: its first chunk costs
        the step nothing and its last chunk, in the next step, is shorter (a 344-token
        step padded to 512 fills the 168 tokens with the next prompt's first chunk). 0 when
        another row would take the step into a larger row bucket (``prefill_rows``)."""
        rows = len(plan.prefill)
        if self.prefill_bucket is None or (self.prefill_rows is not None
                                           and self.prefill_rows(rows + 1) > self.prefill_rows(rows)):
            return 0
        tokens = sum(len(r.token_ids) for r in plan.prefill)
        return max(0, min(budget, self.prefill_bucket(tokens) - tokens))

    def _admit(self, req: SchedRequest, budget: int, hit: PrefixHit,
               source: SchedRequest | None = None) -> tuple[PageCopy, ...] | None:
        """Gives req a slot and pages for its next chunk: from its prefix ``hit``
        (:meth:`_prefix_hit`), or forked from ``source``'s prompt. Returns the page copies
        the chunk's row carries (None: no room)."""
        tokens = req.token_ids()
        assert len(tokens) == req.num_tokens, "a waiting request has no tokens in flight"
        # The watermark only holds back admissions next to running requests.
        watermark = self.watermark_pages if self.running else 0
        start = self._admission_start(req, hit, source)
        n = min(len(tokens) - start, budget)
        if start != hit.num_tokens:
            copies = self.kv.fork(req.request_id, source.request_id, start, start + n, watermark)
            if copies is None:
                return None
        else:
            copies = ()
            if not self.kv.allocate_pages(req.request_id, start + n, prefix=hit, watermark=watermark):
                return None
        self.waiting.remove(req)
        req.num_computed = start
        if start == hit.num_tokens:  # (a fork loads nothing from the host tier)
            req.host_cached_tokens += len(hit.host_keys) * self.kv.page_size
        if req.cached_tokens is None:
            req.cached_tokens = min(start, len(req.prompt_ids))
            self.kv.record_lookup(len(req.prompt_ids), req.cached_tokens)
        req.slot = self._free_slots.pop()
        req.token_on_device = False
        req.status = Status.RUNNING
        self.running.append(req)
        return copies

    def _lower_priority_victim(self, req: SchedRequest) -> SchedRequest | None:
        """The running request waiting `req` takes the slot of when none is free: the
        newest of the lowest priority below req's (flex work first, then default work
        for a priority request), or None."""
        lower = [r for r in self.running if r.priority > req.priority]
        return max(lower, key=lambda r: (r.priority, r.arrival)) if lower else None

    def _reserve_pages(self, req: SchedRequest, num_tokens: int, plan: StepPlan) -> bool:
        """Makes req hold pages for its first num_tokens tokens, preempting others if needed.

        Returns False if req itself was preempted or preemption needs a sync first.
        """
        while not self.kv.allocate_pages(req.request_id, num_tokens):
            if self.num_inflight:
                plan.needs_sync = True
                return False
            victim = max(self.running, key=lambda r: (r.priority, r.arrival))
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    def _preempt(self, req: SchedRequest, plan: StepPlan) -> None:
        assert req.num_inflight == 0
        self.running.remove(req)
        self._free_slots.append(req.slot)
        req.slot = None
        self.kv.free(req.request_id)
        req.num_computed = 0
        req.token_on_device = False
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.append(req)
        plan.decode = [r for r in plan.decode if r.request_id != req.request_id]
        plan.verify = [r for r in plan.verify if r.request_id != req.request_id]
        plan.prefill = [r for r in plan.prefill if r.request_id != req.request_id]
        plan.preempted.append(req.request_id)

    def _cache_full_pages(self, req: SchedRequest) -> None:
        """Offers the request's full, computed, host-known pages to the prefix cache."""
        n = min(req.num_computed, len(req.prompt_ids) + len(req.output_ids))
        # Only when a page has filled up since the last call (token_ids() copies the tokens).
        if n >= self.kv.num_cached_tokens(req.request_id) + self.kv.page_size:
            self.kv.cache_pages(req.request_id, req.token_ids(), n, req.salt, req.images)

    def check_invariants(self) -> None:
        """Asserts page, slot and budget invariants (tests call this after every step).

        Raises:
          AssertionError: describing the first violation.
        """
        self.kv.check_invariants()
        slots = [r.slot for r in self.running]
        assert len(set(slots)) == len(slots) and None not in slots, f"slots {slots}"
        assert sorted(slots + self._free_slots) == list(range(self.num_slots))
        running = {r.request_id for r in self.running}
        assert len(running) == len(self.running), "two running requests share an id"
        holders = set(self.kv.request_ids())  # pinned holders (KV transfers) are not requests
        assert holders <= running, f"requests {sorted(holders - running)} hold pages but do not run"
        for r in self.waiting:
            assert r.slot is None and r.num_inflight == 0 and r.status is Status.WAITING
            assert r.request_id not in running, f"request {r.request_id!r} both waits and runs"
        for r in self.running:
            assert len(self.kv.page_ids(r.request_id)) * self.kv.page_size >= r.num_computed
        live = self.waiting + self.running
        assert self._live == {r.request_id: r for r in live}, "the live table differs from the queues"
        for r in live:
            root = self._live.get(r.parent_id) if r.parent_id is not None else None
            assert root is None or root.parent_id is None, f"request {r.request_id!r}: parent is a child"
