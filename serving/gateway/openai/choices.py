"""One HTTP request, several completions: prompts times choices (``n``, ``best_of``).

A completions request may carry several prompts (OpenAI's list forms), and
both endpoints take ``n``; ``/v1/completions`` also ``best_of``. Each
(prompt i, choice j) is its own :class:`EngineRequest`, submitted prompt by
prompt, choice 0 first:

- ids: the response id itself when there is a single completion, else
  ``{response id}-{k}`` with k = i * per_prompt + j (``per_prompt`` is
  ``best_of`` when given, else ``n``);
- ``parent_id``: choice 0's id for the other choices of the same prompt, so
  the engine computes that prompt once and the choices share its KV pages;
- seed: ``seed + j`` (wrapped into int64), so ``n=3`` with seed s equals
  three requests with seeds s, s+1, s+2 (vLLM's rule); no seed stays none
  (each choice draws its own);
- ``prompt_logprobs`` only on choice 0 (the choices of a prompt share it).

Responses index choices prompt-major: prompt i's choice j is ``i * n + j``.
With ``best_of`` the completions of a prompt are ranked by cumulative log
probability (the sum over its generated tokens, stop token included, as
vLLM and OpenAI rank them) and the best ``n`` are returned, best first;
``usage`` bills all of them (OpenAI's rule). Usage counts each prompt once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from serving.contract.engine_client import EngineRequest, SamplingParams
from serving.output.output_processor import TextGeneration

_INT64 = 2**64


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice `j`: ``seed + j`` wrapped into int64 (None stays None)."""
    if seed is None:
        return None
    return (seed + j + _INT64 // 2) % _INT64 - _INT64 // 2


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one engine request sits: prompt `prompt` (index into the prompts),
    choice `choice` of it (0..per_prompt-1)."""

    prompt: int
    choice: int


def fan_out(response_id: str, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
            per_prompt: int, *, priority: str = "interactive", cache_salt: str | None = None,
            arrival_time: float | None = None, images: tuple = (), lora_name: str | None = None
            ) -> tuple[list[EngineRequest], list[Slot]]:
    """The engine requests of every (prompt, choice), in submission order.

    Args:
      response_id: the HTTP response's id (the engine ids derive from it).
      prompts: token ids of each prompt.
      sampling: the settings of every choice (``seed`` is the request's).
      per_prompt: completions per prompt (>= 1).
      images: the ``ImageInput``s of a single prompt (a chat's), passed to each of its choices.
      lora_name: the LoRA adapter that serves every choice (None: the base model).

    Returns:
      (requests, slots): parallel lists, prompt-major.
    """
    arrival = time.time() if arrival_time is None else arrival_time
    total = len(prompts) * per_prompt
    requests, slots = [], []
    for i, ids in enumerate(prompts):
        parent = None
        for j in range(per_prompt):
            k = i * per_prompt + j
            rid = response_id if total == 1 else f"{response_id}-{k}"
            # Only a prompt's first choice scores it (the others reuse its entries and are
            # forked from its pages), except with max_tokens 0: a choice that generates
            # nothing is the prompt's scoring alone, which the engine only takes as such.
            scores = j == 0 or sampling.max_tokens == 0
            sp = dataclasses.replace(
                sampling, seed=choice_seed(sampling.seed, j),
                prompt_logprobs=sampling.prompt_logprobs if scores else None)
            requests.append(EngineRequest(
                request_id=rid, prompt_ids=list(ids), sampling=sp, arrival_time=arrival,
                priority=priority, cache_salt=cache_salt, parent_id=parent, images=tuple(images),
                lora_name=lora_name))
            slots.append(Slot(i, j))
            if j == 0:
                parent = rid
    return requests, slots


def cumulative_logprob(output: TextGeneration) -> float:
    """The sum of the generated tokens' logprobs (what ``best_of`` ranks by)."""
    return sum(e.logprob for e in output.logprobs)


def pick_best(outputs: Sequence[TextGeneration], slots: Sequence[Slot], n: int) -> list[tuple[int, int]]:
    """For ``best_of``: [(response index, output position)] of the best `n`
    completions of each prompt, best first, prompt-major (index ``i * n + rank``).
    Ties keep the earlier choice first."""
    by_prompt: dict[int, list[int]] = {}
    for pos, slot in enumerate(slots):
        by_prompt.setdefault(slot.prompt, []).append(pos)
    picked = []
    for i in sorted(by_prompt):
        ranked = sorted(by_prompt[i], key=lambda pos: -cumulative_logprob(outputs[pos]))
        picked += [(i * n + rank, pos) for rank, pos in enumerate(ranked[:n])]
    return picked
