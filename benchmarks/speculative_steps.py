"""Where a speculating stream's time goes: each synced step of one stream drafted by ``self:int8``.

    python -m benchmarks.speculative_steps --quantization int8 --draft-vocabs 32768 --ks 1 2 4
    python -m benchmarks.speculative_steps --quantization none --draft-vocabs 32768 --ks 1 4

One prose prompt (``benchmarks.speculative``'s first, 20 tokens) decodes 32 greedy tokens with
speculation, then 32 without, on an engine per (draft vocabulary, K) of the served weights
``--quantization``; every engine step and draft proposal is timed alone (dispatch to the
result, synced), which slows the stream a little: compare the steps, not the tokens/s with
``benchmarks.speculative``'s. Printed per engine: the median milliseconds of the plain decode
step, the propose step (K draft steps in one program) and the verify step (K + 1 tokens).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--quantization", default="int8", choices=["none", "int8"])
    ap.add_argument("--draft-vocabs", type=int, nargs="+", default=[32768])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    import jax

    from benchmarks.speculative import prose_prompts, run_streams
    from serving.config.engine_config import EngineConfig
    from serving.config.speculative_config import SpeculativeConfig
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.engine.engine import Engine
    from serving.loading.model_registry import load_model
    from serving.runtime.engine_loop import EngineLoop

    enable_compilation_cache()
    model, tok = load_model(args.model, dtype="bfloat16", progress=False, quantization=args.quantization)
    policy = BackendPolicy.detect(None, cpu_kernels="auto")
    prompts = prose_prompts(tok, 1, 20)
    times = collections.defaultdict(list)

    def timed(obj, name, key):
        call = getattr(obj, name)

        def run(*a, **kw):
            t = time.perf_counter()
            out = call(*a, **kw)
            jax.block_until_ready(out)
            times[key(a)].append(time.perf_counter() - t)
            return out

        setattr(obj, name, run)

    print(f"{args.model}, served weights {args.quantization}, one stream, {args.new_tokens} tokens", flush=True)
    for vocab in args.draft_vocabs:
        for k in args.ks:
            spec = SpeculativeConfig("draft", k, max_batch=1, draft_model="self:int8", draft_vocab=vocab)
            engine = Engine(model, EngineConfig(max_slots=2, num_pages=256, max_model_len=1024, speculative=spec,
                                                min_decode_batch=1), policy=policy)
            timed(engine.draft, "propose", lambda a: "propose")
            timed(engine, "_dispatch", lambda a: a[0].kind)
            loop = EngineLoop(engine)
            loop.start(warmup=False)
            for spec_on in (True, False):  # compile both ways first
                loop.scheduler.speculative = spec if spec_on else None
                run_streams(loop, prompts, 12)
            times.clear()
            loop.scheduler.speculative = spec
            r = run_streams(loop, prompts, args.new_tokens)
            loop.scheduler.speculative = None
            run_streams(loop, prompts, args.new_tokens)
            loop.stop()
            steps = "; ".join(f"{kind} {1000 * statistics.median(times[kind]):.1f} ms (x{len(times[kind])})"
                              for kind in ("decode", "propose", "verify") if times[kind])
            print(f"  draft vocab {vocab} K={k}: {steps}; acceptance "
                  f"{r['accepted_tokens'] / max(r['draft_tokens'], 1):.2f}", flush=True)


if __name__ == "__main__":
    main()
