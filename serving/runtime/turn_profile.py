"""Where the engine loop's time goes: lifetime seconds of each part of its turns.

One turn of ``serving.runtime.engine_loop.EngineLoop`` plans a step, dispatches
its prefill and decode programs, and reads back the previous turn's tokens
while they run (pipelining). The profile splits a turn's wall time into:

* ``plan``: the scheduler's plan and the stats snapshot (host);
* ``dispatch_prefill`` / ``dispatch_decode``: building the step batch and
  calling the compiled program (host; on a backend that runs programs
  synchronously this includes the device time);
* ``readback_wait``: waiting for a step's sampled tokens to reach the host
  (device time not hidden behind the host work of the next turn);
* ``readback_host``: per-token Python work once they are there (stop checks,
  structured-output matchers, log probabilities, events to the streams);
* ``other``: the rest of the turn (the host KV tier's copies, the inbox,
  verify steps), turn time less the parts above.

Time spent blocked waiting for work while idle is not counted. Turns are
counted by what they dispatched (``mixed``: prefill and decode rows,
``prefill``, ``decode``, ``other``: verify steps only or nothing), with the
prefill tokens and decode rows they carried, so that a benchmark reading the
counters before and after a run (``benchmarks.closed_loop``) gets the average
turn of that run. Exposed as ``xlaserve:engine_turn_seconds_total{part}``,
``xlaserve:engine_turns_total{kind}`` and ``xlaserve:engine_step_tokens_total{kind}``
(``serving.gateway.services.metrics``).
"""

from __future__ import annotations

import time

PARTS = ("plan", "dispatch_prefill", "dispatch_decode", "readback_wait", "readback_host", "other")
TURN_KINDS = ("mixed", "prefill", "decode", "other")


class TurnProfile:
    """Lifetime counters of the loop's turns; written by the loop thread only.

    ``snapshot()`` returns a plain dict (seconds per part, turns per kind,
    ``prefill_tokens``, ``decode_rows``) that other threads may read.
    """

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.turns = dict.fromkeys(TURN_KINDS, 0)
        self.prefill_tokens = 0
        self.decode_rows = 0
        self._turn_start: float | None = None
        self._named = 0.0  # seconds of named parts in the current turn

    def start_turn(self) -> None:
        """Marks the start of a turn's work (after any idle wait)."""
        self._turn_start = time.perf_counter()
        self._named = 0.0

    def add(self, part: str, seconds: float) -> None:
        """Adds ``seconds`` to ``part`` (one of PARTS but ``other``)."""
        self.seconds[part] += seconds
        self._named += seconds

    def end_turn(self, prefill_tokens: int, decode_rows: int) -> None:
        """Closes the turn: counts it by kind and puts its unnamed time under ``other``."""
        if self._turn_start is None:
            return
        total = time.perf_counter() - self._turn_start
        self.seconds["other"] += max(0.0, total - self._named)
        self._turn_start = None
        kind = ("mixed" if prefill_tokens and decode_rows else "prefill" if prefill_tokens
                else "decode" if decode_rows else "other")
        self.turns[kind] += 1
        self.prefill_tokens += prefill_tokens
        self.decode_rows += decode_rows

    def snapshot(self) -> dict[str, float]:
        """``{"seconds.<part>": s, "turns.<kind>": n, "prefill_tokens": n, "decode_rows": n}``."""
        out: dict[str, float] = {f"seconds.{p}": s for p, s in self.seconds.items()}
        out.update({f"turns.{k}": n for k, n in self.turns.items()})
        out["prefill_tokens"] = self.prefill_tokens
        out["decode_rows"] = self.decode_rows
        return out
