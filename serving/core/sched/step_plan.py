"""The step plan: what the scheduler hands the engine each step, as plain value records.

A plan is decided on the host (``serving.core.sched.scheduler``, no JAX) and executed on
device (``serving.engine.engine``); it holds no live request objects, so the engine
loop, the real engine and the scheduler tests' fake engine all read the same
facts from it: which slot, which positions, which token ids, which pages::

    prefill row:  tokens [start, start + len(token_ids)) of one sequence      (a prompt chunk,
                  K/V written into page_ids; samples the next token if         a recompute after
                  ``samples`` (the chunk ends the sequence's known tokens)     preemption, or the
                                                                               rest after a prefix hit)
    decode row:   one token at ``position``: the token the previous step sampled
                  into ``slot`` on device (the host need not have read it back)
    verify row:   a decode row with ``draft_ids`` (speculative decoding): the last token
                  at ``position`` and the drafts after it, verified in one step
                  (``serving.core.sched.speculative``, ``serving.engine.verify_step``)

Positions are absolute (0 = the first prompt token). ``page_ids`` lists the
sequence's pages in order and covers at least every position the row writes.
A forked request's first prefill row (``page_copy``) also has one page copied
into its pages before the step writes anything (``serving.core.kv.kv_cache_manager``).
"""

from __future__ import annotations

import dataclasses

from serving.core.kv.kv_cache_manager import PageCopy


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """One row's sampling settings (host side; the engine packs them into device arrays).

    Attributes:
      temperature: 0.0 = greedy (argmax); otherwise logits are divided by it.
      top_k: keep the k most likely tokens; 0 = off.
      top_p: nucleus mass in (0, 1]; 1.0 = off.
      seed: the request's seed, taken modulo 2**32; the random stream is keyed by
        (seed, position), so a sample never depends on batch neighbours.
      min_p: drop tokens below min_p times the most likely one's probability; 0.0 = off.
      presence_penalty, frequency_penalty: OpenAI's penalties; 0.0 = off.
      repetition_penalty: vLLM's (CTRL's) penalty over prompt and output tokens; 1.0 = off.
      logit_bias: (token id, bias) pairs, at most ``serving.contract.engine_client.MAX_LOGIT_BIAS``.
      min_tokens: the ``suppress_ids`` cannot be sampled while fewer tokens were generated.
      suppress_ids: the stop ids (EOS included) masked while ``min_tokens`` is unmet,
        at most ``serving.engine.sample.sampling.MAX_SUPPRESS_IDS``.
      logprobs: -1 = off; k in 0..MAX_LOGPROBS: the sampled token's log probability and the
        k most likely alternatives.
      prompt_logprobs: -1 = off; k: every prompt token's log probability (and top k).
      (Applied on device in vLLM's order: ``serving.engine.sample.logits_processors``.)
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    suppress_ids: tuple[int, ...] = ()
    logprobs: int = -1
    prompt_logprobs: int = -1

    @property
    def uses_penalties(self) -> bool:
        """Whether a penalty reads the slot's token counts (so every token must be computed
        in this slot: no prefix-cache hit)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


GREEDY = SamplingSettings()


@dataclasses.dataclass(frozen=True)
class PrefillRow:
    """One sequence's share of a prefill step.

    Attributes:
      request_id: the request the row belongs to.
      slot: the slot it runs in (its sampled token is kept there on device).
      start: position of the first of ``token_ids`` (tokens before it are in the cache).
      token_ids: the token ids to compute, in order.
      page_ids: the sequence's pages in order, covering positions < start + len(token_ids).
      samples: whether the step samples a token after this row (it ends the known tokens).
      sampling: the request's sampling settings (used when ``samples``).
      prompt_len: the request's prompt length: tokens at positions >= it are generated
        ones (recomputed after a preemption), counted as output for the penalties.
      num_generated: tokens the request generated before the one this row samples
        (``min_tokens`` is unmet while it is below ``sampling.min_tokens``).
      next_prompt_id: the prompt token right after this chunk, -1 if the chunk reaches
        the prompt's end (prompt log probabilities score it from the chunk's last logits).
      page_copy: a forked request's first row: the page the engine copies
        (every layer's K and V) before the step's model call; None otherwise.
      lora_slot: the device slot of the request's LoRA adapter (0: the base model;
        ``serving.engine.lora_registry``).
    """

    request_id: str
    slot: int
    start: int
    token_ids: tuple[int, ...]
    page_ids: tuple[int, ...]
    samples: bool
    sampling: SamplingSettings = GREEDY
    page_copy: PageCopy | None = None
    prompt_len: int = 0
    num_generated: int = 0
    next_prompt_id: int = -1
    lora_slot: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The row has prompt tokens to score (its request asked for prompt logprobs)."""
        return self.sampling.prompt_logprobs >= 0 and self.start < self.prompt_len - 1

    @property
    def end(self) -> int:
        """Tokens in the cache after this row (start + number of tokens)."""
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """One running sequence's share of a decode step.

    Attributes:
      request_id: the request the row belongs to.
      slot: its slot; the input token is the one the previous step sampled into it.
      position: the input token's position (= tokens in the cache before this step).
      page_ids: the sequence's pages in order, covering positions <= position.
      sampling: the request's sampling settings.
      num_generated: tokens the request generated before the one this row samples,
        counting those in flight (see ``PrefillRow``).
      last_token: the input token as the host knows it (-1: only on device). Set on
        verify rows, which feed it from the host.
      draft_ids: a verify row's draft tokens, fed at positions position + 1, ...
        (``page_ids`` cover them too); () on a plain decode row.
      prev_token: a verify row's token at ``position - 1`` (a draft model refeeds it:
        ``serving.engine.draft_model``); -1: none or not set.
      lora_slot: as ``PrefillRow.lora_slot`` (a LoRA request is never verified with drafts).
    """

    request_id: str
    slot: int
    position: int
    page_ids: tuple[int, ...]
    sampling: SamplingSettings = GREEDY
    num_generated: int = 0
    last_token: int = -1
    draft_ids: tuple[int, ...] = ()
    lora_slot: int = 0
    prev_token: int = -1


@dataclasses.dataclass
class StepPlan:
    """What one engine step runs.

    Attributes:
      decode: one row per running sequence that feeds its last sampled token
        (one budget token each).
      prefill: prompt / recompute chunks (their token counts fill the rest of the budget).
      verify: speculating rows (decode rows with ``draft_ids``, some possibly empty), run
        as one verify step; 1 + len(draft_ids) budget tokens each.
      preempted: ids of requests preempted while planning (already back in the waiting queue).
      needs_sync: preemption was needed while tokens are in flight; read them
        back and plan again (nothing was planned).
    """

    decode: list[DecodeRow] = dataclasses.field(default_factory=list)
    prefill: list[PrefillRow] = dataclasses.field(default_factory=list)
    verify: list[DecodeRow] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)
    needs_sync: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the step: decode rows, prefill tokens, verify rows' tokens."""
        return (len(self.decode) + sum(len(r.token_ids) for r in self.prefill)
                + sum(1 + len(r.draft_ids) for r in self.verify))

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill or self.verify)
