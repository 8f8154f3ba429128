"""Gateway instances on one host: who wrote a ledger row, and which writers are gone.

Each gateway process that keeps a ledger is an *instance*, with a fresh id
(``gw-`` and 12 hex digits) per start. Its rows carry the id
(``requests.gateway_instance``), and it holds a directory::

    SPOOL_DIR/<database key>/<instance id>/   lock (flock'ed while it runs) | spool.jsonl | replayed

``<database key>`` is a hash of the database URL (password hidden), so a
spool is only ever replayed into the database it was written for, whichever
gateways share the spool directory.

An instance is *gone* when its ``lock`` can be taken: the kernel releases an
``flock`` when its process dies, SIGKILL included, so a live gateway's
directory is never taken over. A directory is created and locked in one step
as far as others can see: it is made under a temporary name (``.new-...``,
never taken over), its lock file created and locked inside, then renamed into
place; a directory without a lock file is skipped (never taken over, never
given one).

A gateway that stops cleanly (:func:`release_instance`) marks its own rows still
"running" (streams cut at the drain timeout, a request its writer never
completed) "interrupted" before its directory goes; if the database cannot be
reached then, or its spool still holds writes, the directory stays, and the
next start takes it over and does the same. At start-up a gateway takes over every gone
instance of its database: it replays that instance's spool (rows completed
before the crash, while the database was away), marks the instance's rows
still "running" as "interrupted", and deletes the directory.

Why rows of gone instances rather than "rows of my own last id": several
gateways may share a data directory (and tests share one), and a gateway that
restarts with a new id still finds what its predecessor left. What this does
not see: a gateway on another host that shares only the database; its rows
are reconciled when a gateway using that host's spool directory starts.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from serving.gateway.accounts.database import requests as requests_table
from serving.gateway.accounts.ledger import replay_spool
from serving.gateway.accounts.ledger_spool import OFFSET_FILE, SPOOL_FILE, LedgerSpool

log = logging.getLogger("xlaserve.ledger")

LOCK_FILE = "lock"
INTERRUPTED = "interrupted: the gateway that admitted this request ({instance}) stopped before it finished"


def database_key(engine: sa.Engine) -> str:
    """16 hex digits naming `engine`'s database (its URL, password hidden)."""
    url = engine.url.render_as_string(hide_password=True)
    return hashlib.sha256(url.encode()).hexdigest()[:16]


class GatewayInstance:
    """This process's instance directory, locked for as long as it runs.

    Args:
      root: the spool directory of one database (``SPOOL_DIR/<database key>``).

    Attributes:
      id: the instance id written on this gateway's rows.
      directory: where its spool lives.

    Raises:
      OSError: the directory cannot be created or locked.
    """

    def __init__(self, root: Path) -> None:
        self.id = "gw-" + uuid.uuid4().hex[:12]
        self.directory = Path(root) / self.id
        staging = Path(root) / f".new-{self.id}"
        for attempt in range(3):  # the parent may be removed by another gateway's release meanwhile
            try:
                staging.mkdir(parents=True)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        self._lock = _try_lock(staging, create=True)
        assert self._lock is not None, "a fresh instance directory is locked by someone"
        os.rename(staging, self.directory)  # appears with its lock held

    def release(self, remove: bool) -> None:
        """Unlocks the directory; with `remove`, deletes it first (nothing left to replay)."""
        if self._lock is None:
            return
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)
            _remove_if_empty(self.directory.parent)
        os.close(self._lock)
        self._lock = None


def take_over_gone_instances(root: Path, engine: sa.Engine, by: str) -> list[dict]:
    """Replays the spool of every gone instance under `root` into `engine` and
    marks its rows left "running" as "interrupted"; deletes its directory.

    Args:
      by: the id of the instance doing it (recorded in the rows' traces).

    Returns:
      One dict per instance taken over: instance, replayed (records), interrupted (rows).
      An instance whose spool cannot be replayed now (the database went away
      again) is left for the next start and logged.
    """
    done = []
    if not Path(root).is_dir():
        return done
    for directory in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        if directory.name == by or not directory.name.startswith("gw-"):
            continue  # ours, or one being created (.new-...)
        fd = _try_lock(directory)
        if fd is None:
            continue  # a live gateway
        try:
            if not directory.exists():  # another gateway took it over between listing and locking
                continue
            spool = LedgerSpool(directory, max_bytes=1 << 62)
            try:
                replayed = replay_spool(spool, engine)
            finally:
                spool.close()
            interrupted = mark_interrupted(engine, directory.name, by)
            shutil.rmtree(directory, ignore_errors=True)
            done.append({"instance": directory.name, "replayed": replayed, "interrupted": interrupted})
            log.warning("took over gone gateway instance %s: %d spooled row writes replayed, "
                        "%d running rows marked interrupted", directory.name, replayed, interrupted)
        except Exception as e:  # the next start tries again
            log.error("could not take over gateway instance %s: %r", directory.name, e)
        finally:
            os.close(fd)
    return done


def spooled_x_request_ids(root: Path) -> set[str]:
    """The X-Request-IDs of the rows whose writes still wait in any spool under `root`
    (every instance's, live or gone; read only, whole lines past each ``replayed``
    offset): an admission row, or a completion carrying the admission row it inserts."""
    found: set[str] = set()
    if not Path(root).is_dir():
        return found
    for directory in Path(root).iterdir():
        path = directory / SPOOL_FILE
        try:
            start = int((directory / OFFSET_FILE).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            start = 0
        try:
            with open(path, "rb") as f:
                if start > os.fstat(f.fileno()).st_size:
                    start = 0  # emptied after a full replay, the offset not yet reset
                f.seek(start)
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # an append in progress
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # quarantined when replayed
                    row = record.get("row") if isinstance(record, dict) else None
                    if isinstance(row, dict) and row.get("x_request_id"):
                        found.add(str(row["x_request_id"]))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def settle_spools(ledger, instance: "GatewayInstance", timeout: float = 10) -> set[str]:
    """Brings every spool this host can reach into the database, as far as it can now:
    this gateway's own (``Ledger.settle``), then each gone instance's
    (:func:`take_over_gone_instances`). Batch recovery calls it before it decides that an
    attempt without a ledger row never ran (``batches.py``).

    Returns:
      The X-Request-IDs still spooled after that (:func:`spooled_x_request_ids`): rows of
      a live gateway whose database writes wait, or of a spool that could not be
      replayed now. Their attempts must not be taken for never run.
    """
    ledger.settle(timeout)
    take_over_gone_instances(instance.directory.parent, ledger.engine, instance.id)
    return spooled_x_request_ids(instance.directory.parent)


def mark_interrupted(engine: sa.Engine, instance: str, by: str) -> int:
    """Rows of `instance` still "running" become "interrupted", finished now, with
    the reason in ``error``; what the row holds (its admission, the requested
    tokens in its trace) stays. Returns how many."""
    t = requests_table
    with engine.begin() as conn:
        res = conn.execute(t.update().where(t.c.gateway_instance == instance, t.c.status == "running")
                           .values(status="interrupted", finished_at=time.time(),
                                   error=INTERRUPTED.format(instance=instance) + f"; reconciled by {by}"))
    return res.rowcount


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty (another instance), or gone
        pass


def _try_lock(directory: Path, create: bool = False) -> int | None:
    """An fd holding an exclusive flock on `directory`/lock, or None if someone holds it,
    the directory vanished, or (unless `create`) it has no lock file."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def release_instance(instance: GatewayInstance, ledger) -> int | None:
    """At a clean stop, after `ledger` (a closed ``Ledger``, or None) wrote what it could:
    marks this instance's rows still "running" as "interrupted" and removes its
    directory; a spool left with writes, or a database that cannot be reached now,
    keeps the directory for the next start to take over.

    Returns:
      How many rows were marked (None: left for the next start).
    """
    marked = None
    if ledger is not None and not ledger.spooled_records:
        try:
            marked = mark_interrupted(ledger.engine, instance.id, instance.id)
        except Exception as e:
            log.error("could not mark this gateway's running rows interrupted (%r); the next start "
                      "will", e)
        else:
            if marked:
                log.warning("%d requests still running at shutdown are marked interrupted", marked)
    instance.release(remove=ledger is None or marked is not None)
    return marked


DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def sqlite_path(engine: sa.Engine) -> Path | None:
    """The file of a SQLite database (None: another database, or in memory)."""
    if engine.dialect.name != "sqlite" or not engine.url.database or engine.url.database == ":memory:":
        return None
    return Path(engine.url.database).resolve()


def check_spool_filesystem(root: Path, engine: sa.Engine, spool_max_bytes: int) -> bool:
    """The start-up check of the spool's filesystem (`root` exists).

    The spool exists for when the database cannot take writes; on a filesystem without room
    for it, or on the one a full SQLite database shares, it fails exactly then. So a spool
    with less free space than its bound is refused, and one sharing the SQLite database's
    filesystem is said in the log (and by ``xlaserve:ledger_spool_shares_database_filesystem``).

    Returns:
      Whether the spool shares the SQLite database's filesystem.

    Raises:
      OSError: (ENOSPC) the filesystem has less free space than `spool_max_bytes`.
    """
    free = free_bytes(root)
    if free < spool_max_bytes:
        raise OSError(errno.ENOSPC, f"the ledger spool's filesystem ({root}) has {free} bytes free, less than "
                      f"the spool's bound ({spool_max_bytes} bytes, --ledger-spool-max-bytes): free space, "
                      "lower the bound, or move the spool (--ledger-spool-dir)")
    db = sqlite_path(engine)
    shares = db is not None and db.parent.exists() and os.stat(db.parent).st_dev == os.stat(root).st_dev
    if shares:
        log.warning("the ledger spool (%s) is on the filesystem of the SQLite database (%s): when that "
                    "filesystem fills, both fail together; put the spool elsewhere (--ledger-spool-dir)",
                    root, db)
    return shares


def open_durable_ledger(engine: sa.Engine, spool_dir: str | os.PathLike | None = None,
                        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES):
    """This gateway's ledger with a spool: takes a fresh instance, takes over the
    gone instances of the same database (:func:`take_over_gone_instances`).

    Args:
      spool_dir: the spool directory (None: ``$XLASERVE_DATA_DIR/ledger-spool``).
      spool_max_bytes: the spool's bound (see ``ledger_spool.py``).

    Returns:
      (Ledger, GatewayInstance); release the instance after closing the ledger.

    Raises:
      OSError: the spool directory cannot be created or locked, or its filesystem has
        less room than `spool_max_bytes` (:func:`check_spool_filesystem`).
      ValueError: `spool_max_bytes` below 1.
    """
    from serving.config.server_config import data_dir
    from serving.gateway.accounts.ledger import Ledger

    root = Path(spool_dir) if spool_dir is not None else data_dir() / "ledger-spool"
    root = root / database_key(engine)
    spool_max_bytes = int(spool_max_bytes)
    if spool_max_bytes < 1:
        raise ValueError(f"ledger_spool_max_bytes must be at least 1, got {spool_max_bytes}")
    instance = GatewayInstance(root)
    try:
        shares = check_spool_filesystem(root, engine, spool_max_bytes)
    except OSError:
        instance.release(remove=True)
        raise
    take_over_gone_instances(root, engine, instance.id)
    spool = LedgerSpool(instance.directory, spool_max_bytes)
    spool.shares_database_filesystem = shares
    return Ledger(engine, spool=spool, instance=instance.id), instance
