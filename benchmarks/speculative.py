"""Speculative decoding (n-gram drafts, a draft model) against plain decoding, on prose prompts.

    python -m benchmarks.speculative                               # Gemma 3 270M, bfloat16
    python -m benchmarks.speculative --ks 2 4 8 --streams 1 8 32 --new-tokens 128
    python -m benchmarks.speculative --methods ngram draft --draft-model self:int8 --ks 4
    python -m benchmarks.speculative --methods draft --streams 32 --max-batch 2   # a full batch
    python -m benchmarks.speculative --methods draft --streams 1 4 8 --max-batch 8 --token-budgets 0 10  # K shrinks
    python -m benchmarks.speculative --methods draft --draft-vocabs 0 32768 --quantizations none int8  # issue 46

N streams of prose prompts cut to ``--prompt-len`` tokens generate
``--new-tokens`` tokens each, greedy, through the engine loop: once without
speculation and once per method in ``--methods`` and K in ``--ks`` (one engine
each, built with ``--speculative METHOD --num-speculative-tokens K``, ``--draft-model``
for the draft method, and ``speculative_max_batch`` = ``--max-batch``, by default the
largest stream count, so every step may speculate; each of ``--token-budgets`` gets engines
of its own, 0 the default budget (K throughout), N ``--speculative-token-budget N``, which
shrinks K as the streams grow), alternating for ``--rounds``
rounds; the baseline runs on the first engine with its scheduler's speculation off
(same programs otherwise), or with a draft method in ``--methods`` on an engine of its
own without speculation (a draft engine also prefills its draft). ``self:int8`` drafts get an
engine per ``--draft-vocabs`` value (``--draft-vocab N``; 0: the whole vocabulary). Each of
``--quantizations`` loads the model with those served weights (``--quantization none`` or
``int8``, the default server's for the Gemma GGUF) with engines and a baseline of its own,
measured in the same rounds (a self draft of int8 weights with the whole vocabulary is
refused, and skipped). Engines use the
server's default ``--cpu-kernels auto``. Printed per (streams, method, K): decode tokens/s (tokens
after each stream's first over the time after the first token) and its ratio
to the baseline, the acceptance rate (accepted / proposed drafts), tokens per
verify row (1 + accepted / rows with drafts), the fraction of generated tokens
that came out of verify steps, and whether every stream's ids equal the
baseline's (they must: bfloat16 on XLA:CPU is batch invariant).

Read ratios measured in one run; absolute numbers move with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/speculative.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROSE = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz",
    "Every morning the old fisherman walked down to the harbour before sunrise, carrying a basket",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide",
    "When the railway finally reached the small mountain town, the people who lived there discovered",
    "The city council met on Tuesday evening to discuss the new budget, which includes money for",
    "In the summer of 1969, millions of people gathered around their television sets to watch",
    "A good cup of coffee depends on three things: fresh beans, clean water and the right",
    "The museum's new exhibition brings together more than two hundred paintings from private collections",
    "Our team spent the first week of the project interviewing customers about how they use",
    "The river flows slowly through the valley, past farms and villages that have stood there for",
    "Learning a second language as an adult is difficult, but researchers have found that regular",
    "The storm arrived late in the afternoon, and within an hour the streets of the town were",
    "Bread has been baked for thousands of years, and the basic recipe has hardly changed:",
    "The company announced on Monday that it would open a new factory in the north of the country",
    "My grandmother kept a garden behind her house where she grew tomatoes, beans, and a few",
    "Scientists studying the ocean floor have discovered a new species of fish that lives at depths",
    "The library is open from nine in the morning until eight in the evening on weekdays, and",
    "After years of planning, the expedition set out across the desert with twelve camels and enough",
    "The main reason most people give for moving to the city is the chance to find better",
    "Volcanoes form where molten rock from deep inside the earth rises to the surface through cracks",
    "The teacher asked the students to write a short essay about the most important event in",
    "Cycling to work has become more popular in recent years, as more cities build safe lanes",
    "The first thing you notice when you enter the old cathedral is the light that falls through",
    "Farmers in the region have struggled with dry summers, and many have started to plant crops",
    "The novel tells the story of a young woman who leaves her village to work in a factory",
    "Good software is written for people first and computers second, which is why clear names",
    "The bridge was built in 1883 and was, for a time, the longest suspension bridge in",
    "Honey bees communicate the location of flowers to each other through a dance that tells",
    "On the last day of the festival, the whole town gathered in the square to watch the",
    "Doctors recommend that adults get at least seven hours of sleep each night, because sleep helps",
    "The ship left the port at dawn, carrying wool, wine and olive oil to markets across the",
    "Maps have changed a great deal since the first explorers drew the coastlines they had seen",
]


def prose_prompts(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """n prose prompts (BOS first), each cut to at most prompt_len tokens."""
    out = []
    for i in range(n):
        text = PROSE[i % len(PROSE)]
        out.append(tokenizer.encode(text, add_bos=True)[:prompt_len])
    return out


def run_streams(loop, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy requests, all at once; decode tokens/s, the ids, and the loop's speculation counts."""
    from serving.contract.engine_client import EngineRequest, SamplingParams

    before = dataclasses.replace(loop.spec_counters)

    async def one(i, prompt):
        req = EngineRequest(f"spec-{time.monotonic_ns()}-{i}", prompt,
                            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        times, ids = [], []
        async for ev in loop.submit(req):
            times += [time.perf_counter()] * len(ev.token_ids)
            ids += ev.token_ids
        return times, ids

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    first = min(times[0] for times, _ in results)
    end = max(times[-1] for times, _ in results)
    n = sum(len(times) for times, _ in results)
    c = loop.spec_counters
    rows, drafts, accepted = (c.verify_rows - before.verify_rows, c.draft_tokens - before.draft_tokens,
                              c.accepted_tokens - before.accepted_tokens)
    return dict(decode_tokens_per_s=(n - len(prompts)) / (end - first), tokens=n, verify_rows=rows,
                draft_tokens=drafts, accepted_tokens=accepted, ids=[ids for _, ids in results])


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    ap.add_argument("--draft-model", default="self:int8",
                    help="the draft method's model: self:int8 or what --model takes")
    ap.add_argument("--draft-vocabs", type=int, nargs="+", default=[32768],
                    help="self:int8 draft vocabularies (--draft-vocab), one engine each (0: the whole vocabulary; "
                         "default: the server's, 32768)")
    ap.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "int8"],
                    help="the served weights (--quantization), each its own engines and baseline")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="speculative_max_batch (default: the largest stream count)")
    ap.add_argument("--token-budgets", type=int, nargs="+", default=[0],
                    help="speculative_token_budget values, one engine each: min(K, budget // streams - 1) "
                         "drafts a row (0: the default, K at every stream count up to --max-batch)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--num-pages", type=int, default=1024,
                    help="each engine's KV pages (of 16 tokens; many engines: fewer, within the host's memory)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompt-lookup-min", type=int, default=None)
    ap.add_argument("--prompt-lookup-max", type=int, default=None)
    ap.add_argument("--min-decode-batch", type=int, default=1,
                    help="smallest decode bucket (1: the CPU policy's; 4: bfloat16 rows of 1 and 2 "
                         "round like 3+ on AMX CPUs, so ids compare bitwise)")
    args = ap.parse_args(argv)

    from serving.config.engine_config import EngineConfig
    from serving.config.speculative_config import SELF_INT8, SpeculativeConfig
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.engine.engine import Engine
    from serving.loading.model_registry import load_model
    from serving.runtime.engine_loop import EngineLoop

    enable_compilation_cache()
    print(f"load average at the start: {_loadavg()}", flush=True)
    max_streams = max(args.streams)
    max_batch = args.max_batch or max_streams
    policy = BackendPolicy.detect(None, cpu_kernels="auto")
    targets = {}  # quantization -> (baseline loop, {name: loop})
    for quant in args.quantizations:
        model, tok = load_model(args.model, dtype=args.dtype, progress=False, quantization=quant)
        draft = None
        if "draft" in args.methods and args.draft_model != SELF_INT8:
            from serving.loading.draft_source import check_same_tokenizer

            draft, dtok = load_model(args.draft_model, dtype=args.dtype, progress=False)
            check_same_tokenizer(tok, dtok, model.cfg.vocab_size, draft.cfg.vocab_size)
        loops = {}
        for method in args.methods:
            self_draft = method == "draft" and args.draft_model == SELF_INT8
            vocabs = [v or model.cfg.vocab_size for v in args.draft_vocabs] if self_draft else [None]
            for k in args.ks:
                for budget in args.token_budgets:
                    for vocab in vocabs:
                        if quant != "none" and vocab == model.cfg.vocab_size:
                            print("  (int8 weights: no self draft with the whole vocabulary, skipped)")
                            continue
                        spec = SpeculativeConfig.from_settings(
                            method, k, args.prompt_lookup_min, args.prompt_lookup_max, max_batch,
                            args.draft_model if method == "draft" else None, budget or None, vocab)
                        cfg = EngineConfig(max_slots=max(max_streams, 1), num_pages=args.num_pages, max_model_len=1024,
                                           speculative=spec, min_decode_batch=args.min_decode_batch)
                        engine = Engine(model, cfg, policy=policy, draft=draft if method == "draft" else None)
                        name = (f"{method} K={k}" + (f" budget {budget}" if budget else "")
                                + (f" draft vocab {vocab}" if self_draft else ""))
                        loops[name] = EngineLoop(engine)
                        loops[name].start(warmup=False)
        base_loop = loops[next(iter(loops))]
        if "draft" in args.methods:  # a draft engine prefills its draft too: the baseline has no draft
            plain_cfg = EngineConfig(max_slots=max(max_streams, 1), num_pages=args.num_pages, max_model_len=1024,
                                     min_decode_batch=args.min_decode_batch)
            base_loop = EngineLoop(Engine(model, plain_cfg, policy=policy))
            base_loop.start(warmup=False)
        targets[quant] = (base_loop, loops)
    print(f"{args.model} {args.dtype}, served weights {' and '.join(args.quantizations)}: "
          f"{args.prompt_len}-token prose prompts, {args.new_tokens} new tokens, "
          f"greedy; n-gram {args.prompt_lookup_min or 2}..{args.prompt_lookup_max or 4}; draft model "
          f"{args.draft_model if 'draft' in args.methods else '-'} (draft vocabularies {args.draft_vocabs}, 0: all); "
          f"speculative_max_batch {max_batch}; "
          f"speculative_token_budgets {args.token_budgets} (0: default); "
          f"min decode batch {args.min_decode_batch}; {args.rounds} round(s), medians", flush=True)

    def baseline(base_loop, prompts, new_tokens):
        saved = base_loop.scheduler.speculative
        base_loop.scheduler.speculative = None
        try:
            return run_streams(base_loop, prompts, new_tokens)
        finally:
            base_loop.scheduler.speculative = saved

    for n in args.streams:
        prompts = prose_prompts(tok, n, args.prompt_len)
        # Compile this stream count's programs (decode and verify buckets) outside the timing.
        runs = {}
        for quant, (base_loop, loops) in targets.items():
            baseline(base_loop, prompts, 8)
            for name in loops:
                run_streams(loops[name], prompts, 24)
            runs[quant] = {"off": []} | {name: [] for name in loops}
        for _ in range(args.rounds):
            for quant, (base_loop, loops) in targets.items():
                runs[quant]["off"].append(baseline(base_loop, prompts, args.new_tokens))
                for name in loops:
                    runs[quant][name].append(run_streams(loops[name], prompts, args.new_tokens))
        bases = {quant: statistics.median(r["decode_tokens_per_s"] for r in runs[quant]["off"]) for quant in targets}
        for quant, (_, loops) in targets.items():
            base = bases[quant]
            other = "".join(f", {base / bases[q]:.2f}x {q}'s" for q in targets if q != quant)
            print(f"  streams {n:3} {quant} weights, speculation off: decode {base:7.1f} tokens/s{other}", flush=True)
            for name in loops:
                rs = runs[quant][name]
                tps = statistics.median(r["decode_tokens_per_s"] for r in rs)
                rows = sum(r["verify_rows"] for r in rs)
                drafts = sum(r["draft_tokens"] for r in rs)
                acc = sum(r["accepted_tokens"] for r in rs)
                tokens = sum(r["tokens"] for r in rs)
                same = all(r["ids"] == runs[quant]["off"][0]["ids"] for r in rs)
                other = "".join(f", {tps / bases[q]:.2f}x {q}'s off" for q in targets if q != quant)
                print(f"  streams {n:3} {quant} weights, {name}: decode {tps:7.1f} tokens/s ({tps / base:.2f}x{other}), "
                      f"acceptance {acc / max(drafts, 1):.2f}, tokens per verify row {1 + acc / max(rows, 1):.2f}, "
                      f"{(rows + acc) / tokens:.0%} of tokens from verify rows; ids equal to off: "
                      f"{'yes' if same else 'NO'}", flush=True)
    print(f"load average at the end: {_loadavg()}", flush=True)
    for base_loop, loops in targets.values():
        for lp in {*loops.values(), base_loop}:
            lp.stop()


if __name__ == "__main__":
    main()
