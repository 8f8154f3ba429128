"""Helpers to drive an EngineLoop from synchronous tests."""

from __future__ import annotations

import asyncio
import itertools

from serving.contract.engine_client import EngineRequest, SamplingParams, TokenEvent

_ids = itertools.count()


def request(prompt_ids, **sampling) -> EngineRequest:
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(f"req-{next(_ids)}", list(prompt_ids), SamplingParams(**sampling))


async def collect(loop, req: EngineRequest) -> tuple[list[int], list[TokenEvent]]:
    """Token ids and events of one request, to its end."""
    ids, events = [], []
    async for ev in loop.submit(req):
        ids.extend(ev.token_ids)
        events.append(ev)
    return ids, events


def generate(loop, reqs: list[EngineRequest]) -> list[list[int]]:
    """Runs requests concurrently (they share decode steps); returns each one's ids."""

    async def main():
        return await asyncio.gather(*(collect(loop, r) for r in reqs))

    return [ids for ids, _ in asyncio.run(main())]


def agree_until_near_tie(ours: list[int], golden: dict, cutoff: float = 1e-2) -> None:
    """Greedy ids must match up to the first step whose top1-top2 margin < cutoff (README rule)."""
    ref = golden["greedy"]["ids"]
    margins = golden["greedy"]["step_top1_top2_margin"]
    for step, (a, b) in enumerate(zip(ours, ref)):
        if margins[step] < cutoff:
            return
        assert a == b, f"{golden['name']}: step {step} gave {a}, golden {b} (margin {margins[step]:.4f})"
    assert len(ours) == len(ref), f"{golden['name']}: {len(ours)} tokens, golden {len(ref)}"
