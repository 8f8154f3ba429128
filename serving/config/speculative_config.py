"""Speculative decoding's settings: :class:`SpeculativeConfig` (static: the verify step compiles
for ``num_tokens``). The n-gram proposer and the acceptance rule are
``serving.core.sched.speculative``'s; the draft model's steps ``serving.engine.draft_model``'s."""

from __future__ import annotations

import dataclasses

METHODS = ("ngram", "draft", "eagle3")

MODEL_METHODS = ("draft", "eagle3")
"""The methods whose drafts come from a model (``--draft-model``) on the device."""

SELF_INT8 = "self:int8"
"""``--draft-model self:int8``: draft with the served model's own int8 copy."""

SELF_DRAFT_VOCAB = 32768
"""A self draft's default draft vocabulary (``--draft-vocab``): its head computes logits over 32768
of the served vocabulary's ids (``serving.config.draft_vocab``), 1/8 of Gemma 3's 262144 rows,
holding 95% of the tokens of English prose prompts and 98% of the golden prompts' English greedy
continuations (``python -m benchmarks.draft_vocab``; benchmarks/RESULTS.md, issue 46)."""

DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_MAX_BATCH = 2
"""Running requests above which no step speculates (benchmarks/RESULTS.md, issue 17: on the
2-core XLA:CPU VM 1-2 streams decoded 1.4-1.6x faster with K = 2..4, 4 streams 0.98-1.36x, 8 and
32 streams 0.2-0.8x: a verify step of B rows computes B * (K + 1) tokens, which costs about K + 1
decode steps once the step is compute-bound)."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (static: the verify step compiles for ``num_tokens``).

    Attributes:
      method: "ngram" (prompt lookup), "draft" (a draft model proposes, ``draft_model``) or
        "eagle3" (an EAGLE-3 head, ``draft_model`` its directory: ``model.eagle3``).
      draft_vocab: a self draft's (``self:int8``) draft vocabulary: its head computes logits over
        ``draft_vocab`` of the served vocabulary's ids (``serving.config.draft_vocab``) and
        proposes among those (:meth:`draft_vocab_for`); None: :data:`SELF_DRAFT_VOCAB`, or the
        whole vocabulary when that is smaller. Not for other draft models.
      num_tokens: K, the most draft tokens verified per row and step (1..15).
      prompt_lookup_min: the shortest suffix n-gram that is looked up (>= 1).
      prompt_lookup_max: the longest (>= prompt_lookup_min); longer matches are tried first.
      max_batch: steps speculate only while at most this many requests run
        (the verify step's row buckets go up to it).
      token_budget: the most tokens a verify step computes: with R requests running, each
        gets K_eff = min(K, token_budget // R - 1) drafts (:meth:`tokens_at`), so K shrinks as
        the batch grows and is 0 (plain decode) once R + R does not fit. None: (K + 1) x
        ``max_batch``, which keeps K up to ``max_batch`` requests.
      draft_model: with "draft": what the draft model is, ``self:int8`` (the served model's
        int8 copy) or anything ``--model`` takes (a directory, a GGUF, a Hub id); with
        "eagle3": the head's directory; None otherwise.

    Raises:
      ValueError: naming the setting that is out of range.
    """

    method: str = "ngram"
    num_tokens: int = 4
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    max_batch: int = DEFAULT_MAX_BATCH
    draft_model: str | None = None
    token_budget: int | None = None
    draft_vocab: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if (self.method in MODEL_METHODS) != bool(self.draft_model):
            raise ValueError("--speculative draft needs --draft-model (self:int8, a directory, a GGUF or a "
                             "Hub id), --speculative eagle3 needs --draft-model (an EAGLE-3 head's "
                             "directory), and --draft-model needs --speculative draft or eagle3")
        if self.method == "eagle3" and self.draft_model.startswith("self:"):
            raise ValueError(f"--speculative eagle3 --draft-model {self.draft_model!r}: an EAGLE-3 head is a "
                             "directory (config.json + safetensors)")
        if self.draft_model and self.draft_model.startswith("self:") and self.draft_model != SELF_INT8:
            raise ValueError(f"--draft-model {self.draft_model!r}: the served model's own copy is "
                             f"{SELF_INT8!r} only (4-bit copies wait for 4-bit kernels)")
        if self.draft_vocab is not None:
            if self.draft_model != SELF_INT8:
                raise ValueError(f"--draft-vocab applies to self drafts (--speculative draft --draft-model "
                                 f"{SELF_INT8}), not to --draft-model {self.draft_model!r}")
            if self.draft_vocab <= 0:
                raise ValueError(f"--draft-vocab must be a positive number of token ids, got {self.draft_vocab}")
        if not 1 <= self.num_tokens <= 15:
            raise ValueError(f"num_speculative_tokens must be in 1..15, got {self.num_tokens}")
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.max_batch}")
        if self.token_budget is not None and self.token_budget < 2:
            raise ValueError(f"speculative_token_budget must be >= 2 (one row, one draft), got {self.token_budget}")

    def tokens_at(self, rows: int) -> int:
        """K_eff: the most drafts a request gets in a step while ``rows`` requests run (0: no
        step speculates): min(K, token_budget // rows - 1), 0 above ``max_batch`` rows. A
        verify row computes 1 + K_eff tokens, so the step's tokens stay within the budget: a
        full batch gains nothing from drafts once a step is compute-bound."""
        if rows > self.max_batch:
            return 0
        budget = (self.num_tokens + 1) * self.max_batch if self.token_budget is None else self.token_budget
        return max(0, min(self.num_tokens, budget // max(rows, 1) - 1))

    def draft_vocab_for(self, vocab_size: int) -> int:
        """How many ids a self draft's head computes logits over: N = ``draft_vocab`` or
        min(:data:`SELF_DRAFT_VOCAB`, ``vocab_size``).

        Raises:
          ValueError: ``draft_vocab`` above ``vocab_size`` (the served model's logits)."""
        if self.draft_vocab is None:
            return min(SELF_DRAFT_VOCAB, vocab_size)
        if self.draft_vocab > vocab_size:
            raise ValueError(f"--draft-vocab {self.draft_vocab} exceeds the served model's vocabulary of "
                             f"{vocab_size} ids")
        return self.draft_vocab

    def draft_bucket(self, drafts: int) -> int:
        """The verify step's drafts-per-row width for a step whose longest row has ``drafts``
        (1..K): the next power of two, or K (the step computes S x (width + 1) tokens; one
        program per width)."""
        width = 1
        while width < drafts:
            width *= 2
        return min(width, self.num_tokens)

    @classmethod
    def from_settings(cls, method: str | None, num_tokens: int | None, prompt_lookup_min: int | None,
                      prompt_lookup_max: int | None, max_batch: int | None,
                      draft_model: str | None = None, token_budget: int | None = None,
                      draft_vocab: int | None = None) -> "SpeculativeConfig | None":
        """From the server's flags (None: default). A None ``method`` is off (returns None).

        Raises:
          ValueError: an unknown method, ``num_tokens`` missing, a draft model without the
            draft method (or the reverse), or a setting out of range.
        """
        if method is None:
            if draft_model:
                raise ValueError("--draft-model needs --speculative draft or eagle3")
            if draft_vocab is not None:
                raise ValueError(f"--draft-vocab needs --speculative draft --draft-model {SELF_INT8}")
            return None
        if num_tokens is None:
            raise ValueError("--speculative needs --num-speculative-tokens K")
        lo, hi = prompt_lookup_min, prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        elif lo is None:
            lo = min(DEFAULT_PROMPT_LOOKUP_MIN, hi)
        elif hi is None:
            hi = max(DEFAULT_PROMPT_LOOKUP_MAX, lo)
        return cls(method, num_tokens, lo, hi, DEFAULT_MAX_BATCH if max_batch is None else max_batch,
                   draft_model or None, token_budget, draft_vocab)
