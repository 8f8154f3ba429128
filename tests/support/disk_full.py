"""A full disk for tests: a file-size limit on this process, or ENOSPC on every write a module opens."""

from __future__ import annotations

import builtins
import contextlib
import errno
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


def no_space_on_write(monkeypatch, module) -> None:
    """``open`` in ``module`` raises ``OSError(ENOSPC)`` for any mode that writes (reads still
    work), until ``monkeypatch`` is undone."""

    def full(path, mode="r", *a, **kw):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *a, **kw)

    monkeypatch.setattr(module, "open", full, raising=False)
