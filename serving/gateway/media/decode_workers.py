"""Image work off the event loop, in threads of its own that yield the CPU to everything else.

Decoding a large image (base64, the header check, PNG/JPEG decoding, resizing, the digest) is
seconds of CPU for a 40 Mpx picture. Run in the prompt workers' threads
(``serving.gateway.openai.prompts``), a few such images occupy every thread, and other
tenants' prompts wait behind them for a thread; on a machine with few cores the decodes also
take the cores from the engine's thread and the event loop. So images get a pool of their own
(``threads`` at a time; the rest wait without holding anything), whose threads lower their
own scheduling priority by ``nice`` (Linux schedules threads one by one, so only these
threads are reniced, through ``os.setpriority`` on their thread id): the engine, the event
loop and tokenization run first, and a tenant sending image bombs mostly slows itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger("xlaserve.gateway")

DEFAULT_DECODE_THREADS = 2
DEFAULT_DECODE_NICE = 10


def _lower_priority(nice: int) -> None:
    """Thread initializer: this thread's scheduling priority, `nice` lower (Linux; elsewhere none)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError as e:  # not permitted here: the threads run at the process's priority
        log.warning("image decode threads keep the process's priority (%s)", e)


class DecodeWorkers:
    """Runs image work in its own low-priority threads (see the module docstring).

    Args:
      threads: how many images are worked on at once (>= 1).
      nice: how much lower the threads' scheduling priority is (0: as the process's).

    Raises:
      ValueError: `threads` below 1 or `nice` below 0.
    """

    def __init__(self, threads: int = DEFAULT_DECODE_THREADS, nice: int = DEFAULT_DECODE_NICE) -> None:
        if threads < 1 or nice < 0:
            raise ValueError(f"decode threads must be >= 1 and nice >= 0, got {threads} and {nice}")
        self.nice = nice
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="xlaserve-image", initializer=_lower_priority, initargs=(nice,))

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` in one of the threads; returns or raises what it does."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Stops the threads once their work is done."""
        self._pool.shutdown(wait=False, cancel_futures=True)
