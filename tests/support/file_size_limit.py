"""A file-size limit for this process, standing in for a full disk in tests."""

from __future__ import annotations

import contextlib
import resource
import signal


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE at ``nbytes`` bytes for this process while the block runs: a write past it
    fails with ``OSError(EFBIG)`` (SIGXFSZ is ignored meanwhile, so it does not end the process)."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
