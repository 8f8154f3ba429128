"""The starvation guard: flex-class work that waited or was preempted too long runs as default work.

The scheduler (``serving.core.sched.scheduler``) admits flex-class requests
(``service_tier: "flex"``, Batch API lines) only when no default or priority
request waits, and preempts them first, so a steady stream of interactive work
could hold one back for as long as the stream lasts. Before each admission pass
the guard *protects* every waiting flex-class request preempted more than
``max_preemptions`` times, or waiting more than ``max_wait_s`` seconds since it
was queued: it is promoted to the default class for the rest of its life. It
keeps its arrival order, so it goes ahead of every default request that came
after it, and default work can no longer take its slot.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable


@dataclasses.dataclass
class StarvationGuard:
    """Promotes starved requests of class ``starved_class`` to ``protected_class``.

    Attributes:
      max_preemptions: a request preempted more than this many times is protected
        (None: never for preemptions).
      max_wait_s: a request waiting more than this many seconds since it was queued
        is protected (None: never for waiting).
      clock: seconds, monotonic (tests pass their own).
      num_protected: requests promoted so far.
    """

    max_preemptions: int | None = None
    max_wait_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    num_protected: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_preemptions is not None or self.max_wait_s is not None

    def protect(self, waiting: Iterable, starved_class: int, protected_class: int) -> None:
        """Promotes the starved requests among `waiting` (objects with ``priority``,
        ``num_preemptions``, ``queued_at`` and ``protected``), setting ``protected``."""
        if not self.enabled:
            return
        n, limit, now = self.max_preemptions, self.max_wait_s, self.clock()
        for r in waiting:
            if r.priority == starved_class and ((n is not None and r.num_preemptions > n)
                                                or (limit is not None and now - r.queued_at > limit)):
                r.priority = protected_class
                r.protected = True
                self.num_protected += 1
