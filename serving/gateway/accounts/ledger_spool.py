"""The ledger's spool: an append-only file of row writes the database has not taken yet.

When the ledger database cannot be reached, the ledger's writer thread appends
each row write (a row opened at admission, a row completed at the end) here
instead, fsyncs it, and only then reports the write done; when the database
answers again it replays the records in order and records how far it got.

Format: ``spool.jsonl``, one record a line, each line a JSON object followed by
``\\n``, in the order the writes were made::

    {"op": "open", "row": {...the row's columns...}}
    {"op": "close", "request_id": "...", "values": {...the completed columns...}}

``replayed`` holds the byte offset up to which records are in the database
(written to a temporary file, fsynced and renamed over it, so it is never torn).
A record is counted written only once its whole line, newline included, is
fsynced; a line cut short by a crash has no newline and is cut off when the
spool is opened again. Replay is idempotent (the ledger inserts a row only if
its ``request_id`` is absent and completes only a "running" row), so a crash
between a replayed transaction and the offset's update replays those records
again without doubling anything. Once everything is replayed the file is
truncated to empty and the offset reset to 0 (a larger offset than the file,
left by a crash between the two, reads as 0).

The bound, ``max_bytes``, is on the file's size: :attr:`LedgerSpool.full`
tells the gateway to refuse new requests (see ``ledger.py``); writes of
requests already admitted are appended past it.

Appends are unbuffered (``os.write`` on an ``O_APPEND`` descriptor, then
``fsync``): an append that fails part-way (``ENOSPC``, ``EFBIG``) is cut back
with ``ftruncate`` to the size before it, and the size and record count are then
read back from the file itself, so they never drift from what it holds.

A complete line that is not a JSON object (a disk error, a hand edit) is moved
to ``quarantine.jsonl`` beside the spool when replay reaches it, logged, counted
(:attr:`LedgerSpool.quarantined`, the metric
``xlaserve:ledger_spool_quarantined_total``) and skipped, so it cannot hold the
records behind it back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

SPOOL_FILE = "spool.jsonl"
OFFSET_FILE = "replayed"
QUARANTINE_FILE = "quarantine.jsonl"

log = logging.getLogger("xlaserve.ledger")


class LedgerSpool:
    """The spool file in `directory` (created if missing).

    Args:
      directory: where ``spool.jsonl`` and ``replayed`` live.
      max_bytes: the size in bytes past which :attr:`full` is true.

    Not thread-safe for writers: one thread (the ledger's writer) appends and
    replays; :attr:`depth_records` and :attr:`depth_bytes` may be read from any
    thread.

    Raises:
      OSError: the directory or files cannot be created or read.
      ValueError: `max_bytes` below 1.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"the spool's max_bytes must be at least 1, got {max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.path = self.directory / SPOOL_FILE
        self._offset_path = self.directory / OFFSET_FILE
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.quarantined = 0
        # Whether it shares the SQLite database's filesystem (set by ledger_instances' start-up check).
        self.shares_database_filesystem = False
        self._offset = self._read_offset()
        self._size = self._cut_torn_tail()
        if self._offset > self._size:  # truncated after a full replay, offset not yet reset
            self._offset = 0
            self._write_offset(0)
        self._records = self._count_lines(self._offset)

    # -- state ------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        """Bytes still free on the spool's filesystem (for an unprivileged writer)."""
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    @property
    def depth_records(self) -> int:
        """Records appended and not yet replayed."""
        return self._records

    @property
    def depth_bytes(self) -> int:
        """Bytes of records appended and not yet replayed."""
        return self._size - self._offset

    @property
    def size_bytes(self) -> int:
        """The file's size in bytes (replayed records included until it is emptied)."""
        return self._size

    @property
    def full(self) -> bool:
        """The file holds `max_bytes` or more."""
        return self._size >= self.max_bytes

    # -- writes -----------------------------------------------------------------

    def append(self, records: list[dict[str, Any]]) -> None:
        """Appends `records` and fsyncs them; when this returns they survive a crash.

        Raises:
          OSError: the write or the fsync failed (the disk is full, the file-size
            limit is reached); the file is cut back to where it was and the counts
            read back from it.
          TypeError: a record is not JSON-serializable.
        """
        data = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            self._rollback()
            raise
        with self._lock:
            self._size += len(data)
            self._records += len(records)

    def _rollback(self) -> None:
        """Cuts the file back to the last size known good; the counts come from the file."""
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError as e:  # what is there stays; count it as it is
            log.error("the ledger spool could not be cut back after a failed append: %r", e)
        size = self._cut_torn_tail()
        with self._lock:
            self._size = size
            self._records = self._count_lines(self._offset)

    def read(self, limit: int) -> list[tuple[int, dict[str, Any]]]:
        """Up to `limit` records not yet replayed, oldest first, each with the
        offset just past it (what :meth:`mark_replayed` takes).

        A corrupt line met first is quarantined and skipped (counted replayed); one met
        after good records ends the batch there, to be quarantined by the next read.
        """
        out: list[tuple[int, dict[str, Any]]] = []
        while True:
            for end, line in self._raw_lines(self._offset, limit):
                record = _parse(line)
                if record is not None:
                    out.append((end, record))
                    continue
                if out:  # let the good ones before it be replayed first
                    return out
                self._quarantine(line, end)
                break  # read again from past it
            else:
                return out

    def mark_replayed(self, offset: int, count: int) -> None:
        """Records that the records up to byte `offset` (`count` of them) are in
        the database; empties the file once everything is."""
        self._write_offset(offset)
        with self._lock:
            self._offset = offset
            self._records -= count
        if self._offset == self._size:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            with self._lock:
                self._size = 0
                self._offset = 0
                self._records = 0
            self._write_offset(0)

    def close(self) -> None:
        os.close(self._fd)

    # -- files ------------------------------------------------------------------

    def _quarantine(self, line: bytes, end: int) -> None:
        """Moves the corrupt `line` (ending at byte `end`, the next to replay) to the
        quarantine file, logs and counts it, and marks it replayed."""
        path = self.directory / QUARANTINE_FILE
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.quarantined += 1
        log.error("a corrupt ledger spool record (%d bytes at offset %d) is moved to %s and skipped",
                  len(line), end - len(line), path)
        self.mark_replayed(end, 1)

    def _raw_lines(self, start: int, limit: int | None):
        """(offset past it, the line's bytes) of whole lines from byte `start`."""
        if start >= self._size:
            return
        n = 0
        with open(self.path, "rb") as f:
            f.seek(start)
            pos = start
            while limit is None or n < limit:
                line = f.readline()
                if not line.endswith(b"\n") or pos + len(line) > self._size:
                    return
                pos += len(line)
                n += 1
                yield pos, line

    def _count_lines(self, start: int) -> int:
        return sum(1 for _ in self._raw_lines(start, None))

    def _cut_torn_tail(self) -> int:
        """The size up to the last whole line; a torn last line is cut off."""
        data_end = os.path.getsize(self.path)
        if data_end == 0:
            return 0
        with open(self.path, "rb") as f:
            f.seek(max(0, data_end - 1))
            if f.read(1) == b"\n":
                return data_end
            f.seek(0)
            keep = f.read().rfind(b"\n") + 1
        os.ftruncate(self._fd, keep)
        os.fsync(self._fd)
        return keep

    def _read_offset(self) -> int:
        try:
            return int(self._offset_path.read_text().strip() or 0)
        except FileNotFoundError:
            return 0

    def _write_offset(self, offset: int) -> None:
        tmp = self._offset_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(str(offset))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._offset_path)


def _parse(line: bytes) -> dict[str, Any] | None:
    """A spool line's record, or None when it is no JSON object with an ``op``."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "op" in record else None
