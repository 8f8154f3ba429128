"""What compiling the engine's step programs costs: CPU seconds, the sampler apart or fused.

    python -m benchmarks.compile_cost                                  # tiny-random shape
    python -m benchmarks.compile_cost --shape gemma3-270m --slots 8    # Gemma 3 270M's (random weights)

The engine dispatches each prefill and decode step as two programs: the forward (model, KV write,
token counts) and the sampler (``serving.engine.step_programs.sample_step``), whose shapes are only
(rows, slots, vocab). For the prefill token buckets of one-row prompts and every decode batch
bucket of ``--slots`` at each of ``--decode-contexts`` (page-table widths), this compiles (``jax.jit(...).lower(...).compile()``, the persistent
compilation cache off) each forward, the sampler once per row count, and, as the baseline in the
same command, each step as one fused program (forward then sampler in one ``jit``, the engine's
form before 2026-12-06), and prints the process's CPU seconds for each compile and the totals.
CPU seconds rather than wall time: XLA:CPU compiles a program on one thread, so a busy neighbour
inflates wall time but hardly the CPU time; still, measure on a quiet machine.

Needs only jax, flax and numpy (random weights, ``benchmarks.engine.random_model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax


def _cpu_compile(fn, *args) -> float:
    lowered = fn.lower(*args)
    t0 = time.process_time()
    lowered.compile()
    return time.process_time() - t0


def measure(shape: str, slots: int, buckets: list[int], contexts: list[int]) -> list[tuple[str, float, float]]:
    """[(program, split CPU s, fused CPU s)] for the prefill buckets and decode batches; the
    sampler's compile is counted on the first program of each row count that needs it."""
    from benchmarks.engine import make_engine, random_model
    from serving.config.engine_config import batch_bucket, prefill_rows_bucket
    from serving.core.sched.step_plan import GREEDY, DecodeRow, PrefillRow
    from serving.engine.sample.token_bitmask import pad_rows
    from serving.engine.step_batch import DecodeBatch, PrefillBatch

    engine = make_engine(random_model(shape, "float32"), "float32", slots, max(buckets + contexts) + 1,
                         prefill_chunk=max(buckets))
    cfg = engine.cfg
    null = (0,) * cfg.max_pages_per_seq
    batches = [(f"prefill T={T}", PrefillBatch.from_rows(
        [PrefillRow("b", 0, 0, (0,) * T, null, True, GREEDY)], cfg,
        pad_rows(None, prefill_rows_bucket(1, cfg), engine.mask_words), None)) for T in buckets]
    decode_buckets = sorted({batch_bucket(n, cfg) for n in range(1, slots + 1)})
    batches += [(f"decode B={B} at {c}", DecodeBatch.from_rows([DecodeRow("b", 0, c, null, GREEDY)] * B, cfg,
                                                               pad_rows(None, B, engine.mask_words)))
                for c in contexts for B in decode_buckets]

    def fused(kind):
        def step(params, state, batch, lora):
            state, logits = engine._steps[kind](params, state, batch, lora)
            positions = batch.lengths if kind == "decode" else batch.kv_lens
            slot_tokens, out = engine._sample(state.slot_tokens, state.output_counts, state.prompt_seen,
                                              logits, positions, batch.sampling, batch.slot_ids)
            return dataclasses.replace(state, slot_tokens=slot_tokens), out
        return jax.jit(step, donate_argnums=1)

    rows, sampled = [], set()
    st = engine.state
    for name, batch in batches:
        kind = batch.kind
        split = _cpu_compile(engine._steps[kind], engine.params, st, batch, engine.lora_stacks)
        R = batch.slot_ids.shape[0]
        if R not in sampled:  # the sampler: one program per row count
            sampled.add(R)
            logits = jax.ShapeDtypeStruct((R, engine.model_cfg.vocab_size), jax.numpy.float32)
            positions = batch.lengths if kind == "decode" else batch.kv_lens
            split += _cpu_compile(engine._sample, st.slot_tokens, st.output_counts, st.prompt_seen, logits,
                                  positions, batch.sampling, batch.slot_ids)
        rows.append((name, split, _cpu_compile(fused(kind), engine.params, st, batch, engine.lora_stacks)))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", help="benchmarks.engine.SHAPES name (default tiny)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--prefill-buckets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=[8, 200],
                    help="decode positions (each a page-table width bucket of its own)")
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    rows = measure(args.shape, args.slots, args.prefill_buckets, args.decode_contexts)
    print(f"| {args.shape}, {args.slots} slots | split (forward + sampler) CPU s | fused CPU s |")
    print("|---|---|---|")
    for name, split, fused in rows:
        print(f"| {name} | {split:.2f} | {fused:.2f} |")
    total_s, total_f = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"| total | {total_s:.2f} | {total_f:.2f} (fused / split {total_f / total_s:.2f}x) |")


if __name__ == "__main__":
    main()
