"""A byte-bounded, content-addressed store of KV pages on disk: the tier under the host tier.

The third tier of the prefix cache (device pool -> ``HostKVCache`` -> this store): a page
the host tier evicts is written here, in a file named by its prefix-cache key
(``serving.core.kv.kv_cache_manager.page_hash``: the chained hash of the page's tokens,
everything before them and the request's salt, so a tenant-salted page is only ever found
by the same tenant's prompts), and read back into host memory when a later prompt's
prefix continues here (``serving.runtime.disk_tier_steps``). The files outlive the
process: a store opened over a directory rebuilds its index from them::

    HostKVCache --evicted page--> put() --queue--> writer thread --> DIR/<key hex>.<identity>.kvpage
    read(keys) <-- reader (off the engine loop) <-- checksum + identity checked <-- file

One file per page, named by its key and a digest of the model's and format's identity (so
servers of different models may share a directory without overwriting each other's pages),
written to a temporary name and renamed (never seen half-written)::

    b"XLKVPAGE" | uint32 LE header length | header (JSON, UTF-8) | payload

The header names the model (``model_id``: weights, dtype and quantization, so KV of
another model is never loaded), the KV format (``kv_format``: ``"bfloat16"`` today, the
engine's KV storage format), the key (hex), and each array of the payload (``name``,
``dtype`` as numpy names it, ``shape``, ``offset`` and ``nbytes`` in the payload), with
the payload's BLAKE2b-128 checksum. The payload is a set of named arrays, ``k`` and ``v``
today (each ``[layers, kv_heads, page_size, head_dim]``); a format with scales adds its
scale arrays, and nothing here changes.

Bounds and failures (none fails a request: a page not on disk is recomputed):
  * LRU by bytes: ``max_bytes`` bounds the sum of the files' sizes; a write past it removes
    the least recently used files (written or read) first.
  * A torn, corrupted or unreadable file of this model and format is ignored, counted
    (``corrupt_files``) and removed; a file of another model or format is ignored, counted
    (``foreign_files``) and left alone (another server may own it).
  * The disk full (``ENOSPC``, ``EFBIG``, ``EDQUOT``) or any other ``OSError`` while writing:
    the page is dropped and counted (``dropped_pages``).

Thread-safe: the engine loop puts and asks ``contains``, the writer thread writes, a
reader reads, metrics scrapes read the counters. No JAX here.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"XLKVPAGE"
VERSION = 1
SUFFIX = ".kvpage"
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 20
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


class ForeignPageError(ValueError):
    """A page file of another model or KV format (or another store version)."""


class CorruptPageError(ValueError):
    """A page file that is torn, truncated or whose payload fails its checksum."""


def _dtype(name: str) -> np.dtype:
    """numpy's dtype for ``name``; bfloat16 and the float8 types through ml_dtypes."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def encode_page(key: bytes, arrays: dict[str, np.ndarray], model_id: str, kv_format: str) -> bytes:
    """One page file's bytes: magic, header length, header, payload (see the module docstring).

    Args:
      key: the page's prefix-cache key.
      arrays: the payload, {name: array}, in any dtype numpy (or ml_dtypes) names.
      model_id, kv_format: the identity the header carries.
    """
    parts, meta, offset = [], [], 0
    for name, a in arrays.items():
        b = np.ascontiguousarray(a).tobytes()
        meta.append(dict(name=name, dtype=a.dtype.name, shape=list(a.shape), offset=offset, nbytes=len(b)))
        parts.append(b)
        offset += len(b)
    payload = b"".join(parts)
    header = json.dumps(dict(version=VERSION, model_id=model_id, kv_format=kv_format, key=key.hex(),
                             arrays=meta, payload_bytes=len(payload),
                             checksum=hashlib.blake2b(payload, digest_size=16).hexdigest())).encode()
    return MAGIC + _LEN.pack(len(header)) + header + payload


def read_header(f, model_id: str, kv_format: str) -> tuple[dict, int]:
    """Reads and checks a page file's header from the open binary file ``f``.

    Returns:
      (the header, the payload's offset in the file).

    Raises:
      CorruptPageError: no magic, a header cut short or unreadable.
      ForeignPageError: another version, model or KV format.
    """
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) < len(MAGIC) + _LEN.size or not head.startswith(MAGIC):
        raise CorruptPageError("not a KV page file (no magic) or cut short")
    (n,) = _LEN.unpack(head[len(MAGIC):])
    if n > _MAX_HEADER:
        raise CorruptPageError(f"header of {n} bytes")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CorruptPageError(f"header unreadable: {e}") from None
    if not isinstance(header, dict):
        raise CorruptPageError("header is not an object")
    if header.get("version") != VERSION:
        raise ForeignPageError(f"store version {header.get('version')!r}, this one reads {VERSION}")
    if header.get("model_id") != model_id or header.get("kv_format") != kv_format:
        raise ForeignPageError(f"model {header.get('model_id')!r} format {header.get('kv_format')!r}")
    return header, len(head) + n


def decode_payload(header: dict, payload: bytes) -> dict[str, np.ndarray]:
    """The named arrays of a payload read after ``header``.

    Raises:
      CorruptPageError: the payload's length or checksum differs from the header's, or an
        array does not fit it.
    """
    if len(payload) != header.get("payload_bytes"):
        raise CorruptPageError(f"payload of {len(payload)} bytes, header says {header.get('payload_bytes')}")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
        raise CorruptPageError("payload checksum mismatch")
    out = {}
    try:
        for m in header["arrays"]:
            dt = _dtype(m["dtype"])
            a = np.frombuffer(payload, dt, count=m["nbytes"] // dt.itemsize, offset=m["offset"])
            out[m["name"]] = a.reshape(m["shape"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptPageError(f"array table unreadable: {e}") from None
    return out


class DiskKVStore:
    """Byte-bounded LRU of page key -> named arrays, in files under ``directory``.

    Args:
      directory: where the page files live (created if missing); files already there are
        indexed (this model's and format's, least recently modified first).
      max_bytes: most bytes of page files kept (> 0).
      model_id: the served model's identity (weights, dtype, quantization); files of
        another are never read.
      kv_format: the KV storage format (``"bfloat16"``, ...); files of another are never read.
      writer: whether a writer thread writes queued pages (False: :meth:`put` writes at once,
        on the caller's thread; for tests).

    Attributes (lifetime counters):
      hits: pages read back. misses: reads of keys not held (or unreadable).
      stores: pages written. evictions: files removed by the LRU bound.
      bytes_read, bytes_written: file bytes.
      read_seconds, reads: the time reading pages (files opened, read, checked), and how
        many page reads it covers.
      corrupt_files: torn/corrupt files found (removed). foreign_files: files of another
        model or format found (left alone). dropped_pages: pages not written (disk full or
        another OSError).
      usage_bytes: bytes of the indexed files now.

    Raises:
      ValueError: max_bytes <= 0.
      OSError: the directory cannot be created or listed.
    """

    def __init__(self, directory: str, max_bytes: int, model_id: str, kv_format: str,
                 writer: bool = True) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.directory, self.max_bytes = directory, int(max_bytes)
        self.model_id, self.kv_format = model_id, kv_format
        self.hits = self.misses = self.stores = self.evictions = 0
        self.bytes_read = self.bytes_written = self.reads = 0
        self.read_seconds = 0.0
        self.corrupt_files = self.foreign_files = self.dropped_pages = 0
        self.usage_bytes = 0
        self._tag = hashlib.blake2b(f"{model_id}\0{kv_format}".encode(), digest_size=4).hexdigest()
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> file bytes
        self._pending: dict[bytes, dict[str, np.ndarray]] = {}  # queued, not yet written
        os.makedirs(directory, exist_ok=True)
        self._rebuild_index()
        self._queue: queue.SimpleQueue | None = None
        self._thread = None
        if writer:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._write_loop, name="xlaserve-kv-disk-writer", daemon=True)
            self._thread.start()

    # -- index -------------------------------------------------------------------------

    def path(self, key: bytes) -> str:
        """The file of ``key``."""
        return os.path.join(self.directory, f"{key.hex()}.{self._tag}{SUFFIX}")

    def _rebuild_index(self) -> None:
        found = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(".tmp"):  # a write cut short by a crash
                    _unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX) or not entry.is_file():
                    continue
                name, _, tag = entry.name[:-len(SUFFIX)].partition(".")
                if tag != self._tag:  # another model's or format's page (or no page of ours)
                    self.foreign_files += 1
                    continue
                try:
                    key = bytes.fromhex(name)
                    st = entry.stat()
                    with open(entry.path, "rb") as f:
                        header, offset = read_header(f, self.model_id, self.kv_format)
                    if header.get("key") != key.hex() or st.st_size != offset + header.get("payload_bytes", -1):
                        raise CorruptPageError("size or key differs from the header (torn)")
                except ForeignPageError:
                    self.foreign_files += 1
                    continue
                except (CorruptPageError, ValueError, OSError) as e:
                    log.warning("KV disk tier: %s ignored and removed (%s)", entry.name, e)
                    self.corrupt_files += 1
                    _unlink(entry.path)
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.usage_bytes += size
        self._evict_to(self.max_bytes)
        if found or self.foreign_files or self.corrupt_files:
            log.info("KV disk tier %s: %d pages (%d bytes) found, %d foreign and %d corrupt files ignored",
                     self.directory, len(self._index), self.usage_bytes, self.foreign_files, self.corrupt_files)

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is held (written or queued); not counted, not touched."""
        return key in self._index or key in self._pending

    __contains__ = contains

    def keys(self) -> list[bytes]:
        """The written keys, least recently used first."""
        with self._lock:
            return list(self._index)

    # -- writes ------------------------------------------------------------------------

    def put(self, key: bytes, arrays: dict[str, np.ndarray]) -> bool:
        """Queues one page for the writer (kept, not copied: the caller must not change the
        arrays). A key already held is only touched. Returns whether it was queued."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
            if key in self._pending:
                return False
            self._pending[key] = arrays
        if self._queue is None:
            self._write(key)
        else:
            self._queue.put(key)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued page is written or dropped; whether it was in ``timeout``."""
        if self._queue is None:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Writes what is queued, then stops the writer thread."""
        if self._queue is None or self._thread is None:
            return
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(item)
            except Exception:  # never let one page kill the writer
                log.exception("KV disk tier: writing a page failed")
                with self._lock:
                    self._pending.pop(item, None)
                    self.dropped_pages += 1

    def _write(self, key: bytes) -> None:
        arrays = self._pending[key]
        data = encode_page(key, arrays, self.model_id, self.kv_format)
        path = self.path(key)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with self._lock:  # room first, so the bound holds while the file is written
            self._evict_to(self.max_bytes - len(data))
        try:
            if len(data) > self.max_bytes:
                raise OSError(errno.EFBIG, "a page larger than --kv-disk-max-bytes")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            with self._lock:
                self._pending.pop(key, None)
                self.dropped_pages += 1
            if e.errno in DISK_FULL_ERRNOS:
                log.warning("KV disk tier full (%s): page dropped", e)
            else:
                log.warning("KV disk tier: page not written (%s)", e)
            return
        with self._lock:
            self._pending.pop(key, None)
            old = self._index.pop(key, None)
            self.usage_bytes += len(data) - (old or 0)
            self._index[key] = len(data)
            self.stores += 1
            self.bytes_written += len(data)
            self._evict_to(self.max_bytes)

    def _evict_to(self, limit: int) -> None:
        """Removes least recently used files until the usage is <= limit (under the lock)."""
        while self._index and self.usage_bytes > limit:
            key, size = self._index.popitem(last=False)
            self.usage_bytes -= size
            self.evictions += 1
            _unlink(self.path(key))

    # -- reads -------------------------------------------------------------------------

    def read(self, key: bytes) -> dict[str, np.ndarray] | None:
        """The page's arrays (now the most recently used), or None: not held, or its file is
        gone, torn, corrupt or foreign (then dropped from the index and counted). Blocking
        file I/O: call it off the engine loop."""
        t0 = time.perf_counter()
        with self._lock:
            pending = self._pending.get(key)
            size = self._index.get(key)
            if pending is None and size is None:
                self.misses += 1
                return None
        if pending is not None:
            with self._lock:
                self.hits += 1
            return pending
        try:
            with open(self.path(key), "rb") as f:
                header, _ = read_header(f, self.model_id, self.kv_format)
                if header.get("key") != key.hex():
                    raise CorruptPageError("the header names another key")
                arrays = decode_payload(header, f.read())
        except (CorruptPageError, ForeignPageError, OSError) as e:
            log.warning("KV disk tier: page %s unreadable, ignored (%s)", key.hex(), e)
            with self._lock:
                self.misses += 1
                if not isinstance(e, FileNotFoundError):
                    self.foreign_files += isinstance(e, ForeignPageError)
                    self.corrupt_files += not isinstance(e, ForeignPageError)
                if self._index.pop(key, None) is not None:
                    self.usage_bytes -= size
            if isinstance(e, CorruptPageError):
                _unlink(self.path(key))
            return None
        dt = time.perf_counter() - t0
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.hits += 1
            self.reads += 1
            self.read_seconds += dt
            self.bytes_read += size
        return arrays


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
