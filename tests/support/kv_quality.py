"""What a KV cache format does to Gemma 3 270M's outputs: the measurements behind
tests/model/test_kv_quant_quality.py and ``python -m benchmarks.kv_dtype quality``.

One engine per format (the golden tests' shapes, ``tests.support.gemma_engine.CFG``), bfloat16
weights and activations; on it:

* teacher-forced margins: each golden prompt followed by its 24 golden greedy ids, scored in
  one request (prompt logprobs, top 2): at each step the golden id's logprob minus the best
  other id's (negative where the format ranks another id first);
* free-running greedy ids: 24 tokens after each golden prompt;
* held-out perplexity: ``benchmarks/prose_prompts.jsonl``'s 40 sentences joined into 4 texts of
  10 (about 230 tokens each, BOS first), every token after BOS scored:
  ``exp(-sum logprob / tokens)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from tests.support.engine_helpers import collect, generate, request

PROSE = Path(__file__).resolve().parents[2] / "benchmarks" / "prose_prompts.jsonl"
TEXTS = 4  # prose texts of 10 sentences each


def prose_texts() -> list[str]:
    sentences = [json.loads(line)["prompt"] for line in PROSE.read_text().splitlines() if line.strip()]
    per = len(sentences) // TEXTS
    return [" ".join(sentences[i * per:(i + 1) * per]) for i in range(TEXTS)]


@dataclasses.dataclass
class KvQuality:
    """One format's measurements (see the module docstring).

    Attributes:
      margins: [prompts][24] teacher-forced margins of the golden ids (logprob units).
      greedy: [prompts][24] free-running greedy ids.
      nll: summed negative log-likelihood of the prose texts; tokens: tokens scored.
    """

    margins: list[list[float]]
    greedy: list[list[int]]
    nll: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)


def measure(gemma_params, golden: dict, prose_ids: list[list[int]], kv_cache_dtype: str,
            greedy: bool = True) -> KvQuality:
    """Builds the format's engine, measures it, stops it (``greedy`` False: no free-running
    ids, ``KvQuality.greedy`` empty)."""
    from model.gemma3 import Gemma3
    from serving.engine.engine import Engine
    from serving.runtime.engine_loop import EngineLoop
    from tests.support.gemma_engine import CFG

    cfg, params = gemma_params
    engine_cfg = dataclasses.replace(CFG, kv_dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    loop = EngineLoop(Engine(Gemma3(cfg, params=params, dtype=jnp.bfloat16), engine_cfg))
    loop.start(warmup=False)
    prompts = golden["prompts"]
    scored = [request(p["ids"] + p["greedy"]["ids"], max_tokens=1, ignore_eos=True, prompt_logprobs=2)
              for p in prompts] + [request(ids, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
                                   for ids in prose_ids]

    async def score():
        return await asyncio.gather(*(collect(loop, r) for r in scored))

    try:
        forced = [events for _, events in asyncio.run(score())]
        free = generate(loop, [request(p["ids"], max_tokens=24, ignore_eos=True) for p in prompts]) if greedy else []
    finally:
        loop.stop()
    margins = []
    for p, events in zip(prompts, forced):
        n, steps = p["num_tokens"], len(p["greedy"]["ids"])
        row = []
        for s, entry in enumerate(events[0].prompt_logprobs[n:n + steps]):
            assert entry.token_id == p["greedy"]["ids"][s]
            row.append(entry.logprob - max(lp for tok, lp in entry.top if tok != entry.token_id))
        margins.append(row)
    nll, tokens = 0.0, 0
    for ids, events in zip(prose_ids, forced[len(prompts):]):
        entries = events[0].prompt_logprobs[1:len(ids)]
        assert [e.token_id for e in entries] == list(ids[1:])
        nll -= sum(e.logprob for e in entries)
        tokens += len(entries)
    return KvQuality(margins, free, nll, tokens)


def margin_change(q: KvQuality, ref: KvQuality) -> tuple[float, float]:
    """(max, root mean square) of |margin - reference margin| over every prompt and step."""
    d = np.asarray(q.margins, np.float64) - np.asarray(ref.margins, np.float64)
    return float(np.abs(d).max()), float(np.sqrt(np.mean(d * d)))


def greedy_agreement(q: KvQuality, golden: dict) -> tuple[int, int]:
    """(golden prompts whose 24 greedy ids all equal the golden ones, leading ids that agree in all)."""
    same = lead = 0
    for ids, p in zip(q.greedy, golden["prompts"]):
        ref = p["greedy"]["ids"]
        same += ids == ref
        lead += next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref))
    return same, lead
