"""The usage ledger: one row per admitted request, and the usage queries over it.

Writes go through one writer thread, in order, so the event loop never blocks
on the database: :meth:`Ledger.open_row` queues the admission row (status
"running"), :meth:`Ledger.close_row` queues the completion and returns a
future the gateway awaits before the response's last bytes, so a request whose
client saw the end is on disk (SQLite WAL survives a killed process). Queued
writes are batched into one transaction each turn.

With a spool (``ledger_spool.py``), a write the database cannot take because
it is unreachable is appended to the spool and fsynced instead, and its future
completes then; every later write goes to the spool too, behind it, until the
writer has replayed the spool into the database (tried every ``retry_s``
seconds), so rows reach the database in the order they were written. Each
write is idempotent (a row is inserted only if its ``request_id`` is absent,
and a completion applies only to a "running" row), so a replay repeated after
a crash doubles nothing. A request whose admission row could not be written
(a write the database refused, a spool that failed) is still served, so its
completion carries the whole row and inserts it (``{"op": "close", ...,
"row": ...}``): every admitted request gets its row once it ends.
While the spool is full (or cannot be written),
:attr:`Ledger.admitting` is False and the gateway refuses new requests with
503 rather than serve what it could not meter.

Statuses: "running" (admitted, not finished), "ok", "error", "cancelled"
(the client went away), "rate_limited", "interrupted" (its gateway stopped
before it finished; set at the next start, ``ledger_instances.py``).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import queue
import threading
import time
from typing import Any, Mapping, Sequence

import sqlalchemy as sa

from serving.gateway.accounts.database import is_disk_full, is_unreachable
from serving.gateway.accounts.database import requests as requests_table
from serving.gateway.accounts.ledger_spool import LedgerSpool

log = logging.getLogger("xlaserve.ledger")

GROUP_BY = ("model", "key", "day", "tenant", "status", "service_tier")
_GROUP_COLUMN = {"model": "model", "key": "key_id", "day": "day", "tenant": "tenant", "status": "status",
                 "service_tier": "service_tier"}
INCOMPLETE = ("running", "interrupted")
"""Statuses of rows that never completed (counted as ``incomplete`` by :meth:`Ledger.usage`)."""

REPLAY_CHUNK = 500
"""Spooled writes replayed per database transaction."""

MAX_UNOPENED = 100_000
"""Admission rows that failed to write, kept until their request's completion inserts them
(past this many, the oldest is dropped, logged)."""


def utc_day(t: float) -> str:
    """UTC date "YYYY-MM-DD" of Unix time `t`."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d")


def apply_writes(conn: sa.Connection, records: Sequence[Mapping[str, Any] | None]) -> None:
    """Applies row writes in one go, idempotently.

    Args:
      records: each ``{"op": "open", "row": columns}`` (inserted unless a row with
        its request_id exists) or ``{"op": "close", "request_id": id, "values":
        columns}`` (applied only while the row is "running"; with a ``"row"`` too,
        the admission row the open could not write, that row completed with
        ``values`` is inserted unless a row with its request_id exists); None:
        nothing (a flush marker). Every open is applied before every close: a request's
        close always follows its open, so this is the order they were written
        in as far as any row can tell, and it lets each kind go as one
        executemany (replaying hundreds of spooled writes takes one round trip
        per kind and column set, not one per write).

    Raises:
      ValueError: an unknown op.
    """
    t = requests_table
    opens: dict[tuple, list[dict]] = {}
    closes: dict[tuple, list[dict]] = {}
    late_opens: dict[tuple, list[dict]] = {}  # rows whose open failed, inserted completed
    for record in records:
        if record is None:
            continue
        if record["op"] == "open":
            opens.setdefault(tuple(sorted(record["row"])), []).append(record["row"])
        elif record["op"] == "close":
            closes.setdefault(tuple(sorted(record["values"])), []).append(
                {**{f"v_{k}": v for k, v in record["values"].items()}, "rid": record["request_id"]})
            if record.get("row") is not None:
                row = {**record["row"], **record["values"]}
                late_opens.setdefault(tuple(sorted(row)), []).append(row)
        else:
            raise ValueError(f"unknown ledger write {record['op']!r}")
    _insert_absent(conn, opens)
    for columns, params in closes.items():
        stmt = (t.update().where(t.c.request_id == sa.bindparam("rid"), t.c.status == "running")
                .values({c: sa.bindparam(f"v_{c}") for c in columns}))
        conn.execute(stmt, params)
    _insert_absent(conn, late_opens)


def _insert_absent(conn: sa.Connection, groups: dict[tuple, list[dict]]) -> None:
    """Inserts each row of `groups` (rows grouped by column set) unless its request_id exists."""
    t = requests_table
    dialect = conn.dialect.name
    for rows in groups.values():
        if dialect in ("postgresql", "sqlite"):
            if dialect == "postgresql":
                from sqlalchemy.dialects.postgresql import insert
            else:
                from sqlalchemy.dialects.sqlite import insert
            conn.execute(insert(t).on_conflict_do_nothing(index_elements=["request_id"]), rows)
            continue
        for row in rows:
            if conn.execute(sa.select(t.c.request_id).where(t.c.request_id == row["request_id"])).first() is None:
                conn.execute(t.insert().values(**row))


def replay_spool(spool: LedgerSpool, engine: sa.Engine, chunks: int | None = None) -> int:
    """Replays `spool` into `engine`, :data:`REPLAY_CHUNK` writes a transaction,
    each chunk's offset recorded after its commit.

    Args:
      chunks: at most this many transactions (None: until the spool is empty).

    Returns:
      How many writes were replayed.

    A chunk the database refuses for another reason than being unreachable is
    applied write by write, and a write it still refuses (a row no database
    would take) is logged and skipped, so one bad write cannot hold the
    spool back for ever.

    Raises:
      sqlalchemy.exc.SQLAlchemyError: the database is unreachable or its storage is
        full (what was committed stays replayed; the rest stays spooled).
    """
    done = 0
    while chunks is None or chunks > 0:
        batch = spool.read(REPLAY_CHUNK)
        if not batch:
            break
        records = [record for _, record in batch]
        try:
            with engine.begin() as conn:
                apply_writes(conn, records)
        except Exception as e:
            if is_unreachable(e) or is_disk_full(e):
                raise
            _apply_one_by_one(engine, records)
        spool.mark_replayed(batch[-1][0], len(batch))
        done += len(batch)
        if chunks is not None:
            chunks -= 1
    return done


def _apply_one_by_one(engine: sa.Engine, records: list[Mapping[str, Any]]) -> None:
    for record in records:
        try:
            with engine.begin() as conn:
                apply_writes(conn, [record])
        except Exception as e:
            if is_unreachable(e) or is_disk_full(e):
                raise  # kept for a later replay
            rid = record.get("request_id") or record.get("row", {}).get("request_id")
            log.error("a spooled ledger write (%s of %s) was refused and is dropped: %s",
                      record.get("op"), rid, _first_line(e))


def _first_line(error: BaseException) -> str:
    """A database error's first line, without SQLAlchemy's statement and parameters."""
    text = str(getattr(error, "orig", None) or error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class Ledger:
    """Request rows in the gateway database.

    Args:
      engine: a SQLAlchemy engine (tables created; see ``database.py``).
      spool: where writes go while the database is unreachable (None: they fail,
        logged, as without one).
      instance: the gateway instance id written on each row opened
        (``ledger_instances.py``; None: not recorded).
      retry_s: seconds between attempts to replay the spool while the database is away.
    """

    def __init__(self, engine: sa.Engine, spool: LedgerSpool | None = None,
                 instance: str | None = None, retry_s: float = 1.0) -> None:
        self.engine = engine
        self.spool = spool
        self.instance = instance
        self.retry_s = retry_s
        self.spool_write_failed = False  # the last spool append failed (cleared by one that works)
        # The database refused the last write for full storage (cleared by one it takes); rows
        # go to the spool meanwhile, as while it is unreachable, but this is told apart
        # (``xlaserve:ledger_database_full``, the log) and is no 503 while the spool takes them.
        self.database_full = False
        self.database_full_writes = 0  # writes the full database refused (spooled instead)
        self.replayed_total = 0
        self._next_replay = 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # request_id -> its "running" row that could not be written (writer thread only).
        self._unopened: dict[str, dict] = {}
        self._thread = threading.Thread(target=self._run, name="xlaserve-ledger", daemon=True)
        self._closed = False
        self._thread.start()

    # -- state (any thread) -----------------------------------------------------------

    @property
    def admitting(self) -> bool:
        """False while the spool is full or cannot be written: new requests must be refused."""
        return self.spool is None or not (self.spool.full or self.spool_write_failed)

    @property
    def spooled_records(self) -> int:
        """Writes waiting in the spool for the database (0 without a spool)."""
        return 0 if self.spool is None else self.spool.depth_records

    @property
    def spooled_bytes(self) -> int:
        """Bytes of those writes (0 without a spool)."""
        return 0 if self.spool is None else self.spool.depth_bytes

    # -- writes (any thread; never block) ----------------------------------------

    def _submit(self, record: Mapping[str, Any] | None) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(RuntimeError("the ledger is closed"))
            return fut
        self._queue.put((record, fut))
        return fut

    def open_row(self, row: Mapping[str, Any]) -> concurrent.futures.Future:
        """Queues the insert of a new row (needs request_id, model, priority,
        stream, status, created_at; ``day`` is derived, ``gateway_instance`` is this
        ledger's instance)."""
        values = dict(row)
        values.setdefault("day", utc_day(values["created_at"]))
        if self.instance is not None:
            values.setdefault("gateway_instance", self.instance)
        if isinstance(values.get("trace"), (dict, list)):
            values["trace"] = json.dumps(values["trace"])
        return self._submit({"op": "open", "row": values})

    def close_row(self, request_id: str, values: Mapping[str, Any]) -> concurrent.futures.Future:
        """Queues the update that completes row `request_id` (if it is still "running")."""
        values = dict(values)
        if isinstance(values.get("trace"), (dict, list)):
            values["trace"] = json.dumps(values["trace"])
        return self._submit({"op": "close", "request_id": request_id, "values": values})

    def flush(self, timeout: float | None = 30) -> None:
        """Blocks until everything queued so far is written (to the database or the spool)."""
        self._submit(None).result(timeout)

    def settle(self, timeout: float = 30) -> bool:
        """Writes what is queued and replays the spool now (all of it, while the database
        takes it), instead of at the next retry; blocks.

        Returns:
          True when no write is left in the spool; False when the database refused the
          replay (it stays spooled, replayed later as usual) or `timeout` seconds passed.
        """
        deadline = time.monotonic() + timeout
        while self.spooled_records or self.spool_write_failed:
            if time.monotonic() >= deadline:
                return False
            self._next_replay = 0.0
            self.flush(max(deadline - time.monotonic(), 0.001))  # written ...
            self.flush(max(deadline - time.monotonic(), 0.001))  # ... and the replay after it done
            if self._next_replay > time.monotonic():  # the replay failed: retried later
                return not self.spooled_records
        return True

    def close(self) -> None:
        """Writes what is queued (and tries the spool once more), then stops the writer thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            pending = self.spool is not None and (self.spool.depth_records > 0 or self.spool_write_failed)
            timeout = max(0.0, self._next_replay - time.monotonic()) if pending else None
            try:
                batch = [self._queue.get(timeout=timeout)]
            except queue.Empty:
                batch = []
            while batch and len(batch) < 256:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            ops = [b for b in batch if b is not None]
            if ops:
                self._write(ops)
            if self.spool is not None and (self.spool.depth_records or self.spool_write_failed) and (
                    stop or time.monotonic() >= self._next_replay):
                self._replay(final=stop)
            if stop:
                return

    def _replay(self, final: bool = False) -> None:
        try:
            if self.spool.depth_records:  # a chunk a turn; all of it when stopping
                n = replay_spool(self.spool, self.engine, chunks=None if final else 1)
            else:  # the spool could not be written: is the database back?
                with self.engine.connect() as conn:
                    conn.execute(sa.select(1))
                n = 0
        except Exception as e:
            if is_disk_full(e):
                self.database_full = True
            elif not is_unreachable(e):
                log.error("replaying the ledger spool failed: %s", _first_line(e))
            self._next_replay = time.monotonic() + self.retry_s
            return
        self.replayed_total += n
        self.spool_write_failed = False  # the database answers: writes go to it again
        self.database_full = False
        if n and not self.spool.depth_records:
            log.warning("the ledger database is back: the spool is replayed (%d writes in all)",
                        self.replayed_total)

    def _failed(self, record: Mapping[str, Any] | None, fut: concurrent.futures.Future,
                error: BaseException) -> None:
        """A write that could not be made; a failed admission row waits for its completion."""
        if record is not None and record["op"] == "open" and record["row"].get("status") == "running":
            self._unopened[record["row"]["request_id"]] = record["row"]
            if len(self._unopened) > MAX_UNOPENED:
                rid = next(iter(self._unopened))
                log.error("the admission row of %s was never written and its completion has not come; "
                          "dropped", rid)
                del self._unopened[rid]
        fut.set_exception(error)

    def _attach(self, record: Mapping[str, Any] | None) -> None:
        """Gives a completion the admission row that could not be written, to insert it."""
        if record is not None and record["op"] == "close" and record["request_id"] in self._unopened:
            record["row"] = self._unopened.pop(record["request_id"])

    def _write(self, ops) -> None:
        for record, _ in ops:
            self._attach(record)
        if self.spool is not None and self.spool.depth_records:
            self._spool(ops)  # behind what is spooled already, in order
            return
        try:
            with self.engine.begin() as conn:
                apply_writes(conn, [record for record, _ in ops])
        except Exception as batch_error:
            if self.spool is not None and self._divert(batch_error, len(ops)):
                self._next_replay = time.monotonic() + self.retry_s
                self._spool(ops)
                return
            # One bad row must not lose the others: retry each in its own transaction.
            log.warning("ledger batch of %d failed (%s); writing one by one", len(ops), batch_error)
            for i, (record, fut) in enumerate(ops):
                self._attach(record)
                try:
                    with self.engine.begin() as conn:
                        apply_writes(conn, [record])
                    fut.set_result(None)
                except Exception as e:
                    if self.spool is not None and self._divert(e, len(ops) - i):
                        self._spool(ops[i:])
                        return
                    log.error("ledger write failed: %s", e)
                    self._failed(record, fut, e)
            return
        self.spool_write_failed = False
        self.database_full = False
        for _, fut in ops:
            fut.set_result(None)

    def _spool(self, ops) -> None:
        for record, _ in ops:
            self._attach(record)
        records = [record for record, _ in ops if record is not None]
        try:
            if records:
                self.spool.append(records)
        except Exception as e:
            self.spool_write_failed = True
            log.error("the ledger spool cannot be written (%r): %d row writes lost; new requests "
                      "are refused until it can", e, len(records))
            for record, fut in ops:
                self._failed(record, fut, e)
            return
        self.spool_write_failed = False
        for _, fut in ops:
            fut.set_result(None)

    def _divert(self, error: BaseException, n: int) -> bool:
        """Whether `n` writes that failed with `error` go to the spool: the database is
        unreachable, or its storage is full (told apart: logged as such, counted)."""
        if is_disk_full(error):
            if not self.database_full:
                log.error("the ledger database's storage is full (%s); spooling row writes to %s until "
                          "it takes them", _first_line(error), self.spool.path)
            self.database_full = True
            self.database_full_writes += n
            return True
        if is_unreachable(error):
            log.warning("the ledger database is unreachable (%s); spooling row writes to %s until "
                        "it is back", _first_line(error), self.spool.path)
            return True
        return False

    # -- reads (blocking; call from a worker thread on the event loop) -------------

    def get(self, request_id: str, tenant: str | None = None) -> dict | None:
        """The row whose request_id, or else latest row whose X-Request-ID, is `request_id`.

        Args:
          tenant: only rows of this tenant (None: any).
        """
        t = requests_table
        with self.engine.connect() as conn:
            for cond, order in ((t.c.request_id == request_id, None),
                                (t.c.x_request_id == request_id, t.c.created_at.desc())):
                q = sa.select(t).where(cond)
                if tenant is not None:
                    q = q.where(t.c.tenant == tenant)
                if order is not None:
                    q = q.order_by(order)
                row = conn.execute(q.limit(1)).mappings().first()
                if row is not None:
                    out = dict(row)
                    out["trace"] = json.loads(out["trace"]) if out["trace"] else {}
                    # Earlier requests of the same tenant with the same X-Request-ID: client retries
                    # (another tenant's ids are not this client's, nor its business).
                    same_tenant = (t.c.tenant.is_(None) if out["tenant"] is None else t.c.tenant == out["tenant"])
                    out["retries"] = conn.execute(
                        sa.select(sa.func.count()).select_from(t).where(
                            t.c.x_request_id == out["x_request_id"], same_tenant,
                            t.c.created_at < out["created_at"])).scalar_one() if out["x_request_id"] else 0
                    return out
        return None

    def rows(self, tenant: str | None = None) -> list[dict]:
        """Every row (of `tenant`), oldest first. For tests and exports."""
        q = sa.select(requests_table).order_by(requests_table.c.created_at)
        if tenant is not None:
            q = q.where(requests_table.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def usage(self, start: float | None = None, end: float | None = None, group_by: str = "model",
              tenant: str | None = None) -> list[dict]:
        """Sums per group over rows created in [start, end).

        Args:
          start, end: Unix seconds (None: unbounded).
          group_by: one of :data:`GROUP_BY`.
          tenant: only this tenant's rows (None: all).

        Returns:
          One dict per group, sorted by group: group, requests, incomplete
          ("running" or "interrupted": never completed), errors, prompt_tokens, cached_tokens,
          completion_tokens, reasoning_tokens, total_tokens, cost_usd.

        Raises:
          ValueError: unknown group_by.
        """
        if group_by not in GROUP_BY:
            raise ValueError(f"group_by must be one of {', '.join(GROUP_BY)}; got {group_by!r}")
        t = requests_table
        col = t.c[_GROUP_COLUMN[group_by]]
        q = sa.select(
            col.label("group"),
            sa.func.count().label("requests"),
            sa.func.sum(sa.case((t.c.status.in_(INCOMPLETE), 1), else_=0)).label("incomplete"),
            sa.func.sum(sa.case((t.c.status == "error", 1), else_=0)).label("errors"),
            sa.func.coalesce(sa.func.sum(t.c.prompt_tokens), 0).label("prompt_tokens"),
            sa.func.coalesce(sa.func.sum(t.c.cached_tokens), 0).label("cached_tokens"),
            sa.func.coalesce(sa.func.sum(t.c.completion_tokens), 0).label("completion_tokens"),
            sa.func.coalesce(sa.func.sum(t.c.reasoning_tokens), 0).label("reasoning_tokens"),
            sa.func.coalesce(sa.func.sum(t.c.cost_usd), 0.0).label("cost_usd"),
        ).group_by(col).order_by(col)
        if start is not None:
            q = q.where(t.c.created_at >= start)
        if end is not None:
            q = q.where(t.c.created_at < end)
        if tenant is not None:
            q = q.where(t.c.tenant == tenant)
        with self.engine.connect() as conn:
            out = []
            for r in conn.execute(q).mappings():
                d = {k: (int(v) if k not in ("group", "cost_usd") else v) for k, v in r.items()}
                d["cost_usd"] = float(d["cost_usd"])
                d["total_tokens"] = d["prompt_tokens"] + d["completion_tokens"]
                out.append(d)
            return out
