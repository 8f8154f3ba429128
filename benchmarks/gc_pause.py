"""How long a full garbage collection holds the server, with and without the start-up heap frozen.

    python -m benchmarks.gc_pause [--model tiny-random] [--repeats 3]

Builds the engine and the app as ``xlaserve serve`` does (the test suite's
small shapes: 512-token context, 4 slots, 256 pages), then times
``gc.collect()`` (a generation-2 collection, which holds every thread of the
process) before and after :func:`serving.cli.bootstrap.freeze_startup_heap`, the call
``serve`` makes before it starts answering. A full collection also runs on
its own while serving, whenever enough objects have survived; its time is a
stall of every stream at once.
"""

from __future__ import annotations

import argparse
import gc
import time


def full_collection_ms() -> float:
    """Milliseconds of one ``gc.collect()``."""
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random", help="a registry name or a GGUF path")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from serving.cli.bootstrap import build_engine, freeze_startup_heap
    from serving.config.server_config import load_server_config
    from serving.gateway.app import ServedModel, create_app

    cfg = load_server_config(None, model=args.model, max_model_len=512, max_slots=4, num_pages=256)
    loop, tokenizer, name = build_engine(cfg)
    try:
        create_app({name: ServedModel(name=name, engine=loop, tokenizer=tokenizer, max_model_len=512)})
        tracked = len(gc.get_objects())
        before = [full_collection_ms() for _ in range(args.repeats)]
        freeze_startup_heap()
        after = [full_collection_ms() for _ in range(args.repeats)]
        print(f"{name}: {tracked} objects tracked after start-up, {gc.get_freeze_count()} frozen")
        print("| full collection | before freeze | after freeze |\n|---|---|---|")
        print(f"| ms per gc.collect() | {' / '.join(f'{t:.0f}' for t in before)} "
              f"| {' / '.join(f'{t:.1f}' for t in after)} |")
    finally:
        loop.stop()


if __name__ == "__main__":
    main()
