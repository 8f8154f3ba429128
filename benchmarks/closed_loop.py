"""The closed-loop serving load of ``benchmarks.vs_llamacpp --closed-loop``: prompts and step profile.

A closed loop: N streams, each sending its next request when its last one
ends, 2N or more requests in all, so arrivals keep joining a running batch (the
case of a service under steady load, unlike one wave of N requests that start
together). Its prompts are of mixed length: ``mixed_prompts`` builds them from
``benchmarks/prose_prompts.jsonl``'s sentences, each prompt a run of
consecutive sentences whose count is spread evenly over the asked range of
lengths (interleaved by a seeded shuffle, so long and short prompts arrive
mixed), each opening with its own request number so no two share a
prefix-cache page.

The step profile is read off the server's ``/metrics`` before and after a run
(``xlaserve:engine_turn_seconds_total{part}``, ``xlaserve:engine_turns_total{kind}``,
``xlaserve:engine_step_tokens_total{kind}``, kept by
``serving.runtime.turn_profile``): where the run's engine-loop turns spent their
time (host planning, dispatching the prefill and decode programs, waiting for
the sampled tokens, per-token host work), how many turns mixed prefill and
decode rows, and how many prefill tokens and decode rows a turn carried.
"""

from __future__ import annotations

import random
from typing import Mapping, Sequence

TURN_PARTS = ("plan", "dispatch_prefill", "dispatch_decode", "readback_wait", "readback_host", "other")
TURN_KINDS = ("mixed", "prefill", "decode", "other")
SENTENCE_TOKENS = 22  # about what one prose_prompts.jsonl sentence is in Gemma 3 tokens


def mixed_prompts(sentences: Sequence[str], count: int, min_tokens: int = 20, max_tokens: int = 400,
                  seed: int = 0) -> list[str]:
    """``count`` prompts of about ``min_tokens`` to ``max_tokens`` tokens, lengths spread evenly.

    Prompt i is ``"Request {i}. "`` and then k_i consecutive sentences from
    sentence i onwards (cycling), k_i from ``min_tokens / SENTENCE_TOKENS`` to
    ``max_tokens / SENTENCE_TOKENS`` (at least 1) in even steps, in an order
    shuffled by ``seed``. Token counts are approximate: the caller tokenizes.

    Raises:
      ValueError: no sentences, count < 1, or min_tokens > max_tokens.
    """
    if not sentences or count < 1 or min_tokens > max_tokens:
        raise ValueError(f"mixed_prompts: {len(sentences)} sentences, count {count}, "
                         f"lengths {min_tokens}..{max_tokens}")
    lo = max(1, round(min_tokens / SENTENCE_TOKENS))
    hi = max(lo, round(max_tokens / SENTENCE_TOKENS))
    ks = [lo + round((hi - lo) * j / max(1, count - 1)) for j in range(count)]
    random.Random(seed).shuffle(ks)
    n = len(sentences)
    return [" ".join([f"Request {i}."] + [sentences[(i + j) % n] for j in range(k)]) for i, k in enumerate(ks)]


def scrape_profile(metrics_text: str) -> dict[str, float]:
    """The turn profile's counters in a Prometheus text exposition, summed over models.

    Returns ``{"seconds.<part>", "turns.<kind>", "prefill_tokens", "decode_rows"}`` (those present).
    """
    from prometheus_client.parser import text_string_to_metric_families

    names = {"xlaserve:engine_turn_seconds": ("seconds", "part"), "xlaserve:engine_turns": ("turns", "kind")}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            base = sample.name[: -len("_total")]
            if base in names:
                group, label = names[base]
                key = f"{group}.{sample.labels.get(label)}"
            elif base == "xlaserve:engine_step_tokens":
                key = "prefill_tokens" if sample.labels.get("kind") == "prefill" else "decode_rows"
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


def profile_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per counter (a counter missing before counts as 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def format_profile(delta: Mapping[str, float]) -> str:
    """One run's profile as text: per-turn milliseconds and shares by part, turns by kind, rows per turn.

    Returns "no turn profile" when the server kept none (a remote engine, or an older server).
    """
    turns = sum(delta.get(f"turns.{k}", 0.0) for k in TURN_KINDS)
    total = sum(delta.get(f"seconds.{p}", 0.0) for p in TURN_PARTS)
    if turns <= 0 or total <= 0:
        return "no turn profile"
    parts = ", ".join(f"{p} {delta.get(f'seconds.{p}', 0.0) / turns * 1e3:.2f} ms "
                      f"({delta.get(f'seconds.{p}', 0.0) / total:.0%})" for p in TURN_PARTS)
    kinds = ", ".join(f"{k} {int(delta.get(f'turns.{k}', 0.0))}" for k in TURN_KINDS)
    with_prefill = delta.get("turns.mixed", 0.0) + delta.get("turns.prefill", 0.0)
    with_decode = delta.get("turns.mixed", 0.0) + delta.get("turns.decode", 0.0)
    rows = (f"prefill tokens per turn with prefill {delta.get('prefill_tokens', 0.0) / with_prefill:.1f}"
            if with_prefill else "no prefill turns")
    rows += (f", decode rows per turn with decode {delta.get('decode_rows', 0.0) / with_decode:.1f}"
             if with_decode else ", no decode turns")
    return (f"{int(turns)} turns, {total / turns * 1e3:.2f} ms per turn: {parts}\n"
            f"turns: {kinds}; {rows}")
