"""The usage ledger: one row per admitted request, and the usage queries over it.

Writes go through one writer thread, in order, so the event loop never blocks
on the database: :meth:`Ledger.open_row` queues the admission row (status
"running"), :meth:`Ledger.close_row` queues the completion and returns a
future the gateway awaits before the response's last bytes, so a request whose
client saw the end is on disk (SQLite WAL survives a killed process). Queued
writes are batched into one transaction each turn.

Statuses: "running" (admitted, not finished: after a crash it stays so),
"ok", "error", "cancelled" (the client went away), "rate_limited".
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import queue
import threading
from typing import Any, Callable, Mapping

import sqlalchemy as sa

from serving.gateway.accounts.database import requests as requests_table

log = logging.getLogger("xlaserve.ledger")

GROUP_BY = ("model", "key", "day", "tenant", "status", "service_tier")
_GROUP_COLUMN = {"model": "model", "key": "key_id", "day": "day", "tenant": "tenant", "status": "status",
                 "service_tier": "service_tier"}


def utc_day(t: float) -> str:
    """UTC date "YYYY-MM-DD" of Unix time `t`."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d")


class Ledger:
    """Request rows in the gateway database.

    Args:
      engine: a SQLAlchemy engine (tables created; see ``database.py``).
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="xlaserve-ledger", daemon=True)
        self._closed = False
        self._thread.start()

    # -- writes (any thread; never block) ----------------------------------------

    def _submit(self, op: Callable[[sa.Connection], None]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(RuntimeError("the ledger is closed"))
            return fut
        self._queue.put((op, fut))
        return fut

    def open_row(self, row: Mapping[str, Any]) -> concurrent.futures.Future:
        """Queues the insert of a new row (needs request_id, model, priority,
        stream, status, created_at; ``day`` is derived)."""
        values = dict(row)
        values.setdefault("day", utc_day(values["created_at"]))
        if isinstance(values.get("trace"), (dict, list)):
            values["trace"] = json.dumps(values["trace"])
        return self._submit(lambda conn: conn.execute(requests_table.insert().values(**values)))

    def close_row(self, request_id: str, values: Mapping[str, Any]) -> concurrent.futures.Future:
        """Queues the update that completes row `request_id`."""
        values = dict(values)
        if isinstance(values.get("trace"), (dict, list)):
            values["trace"] = json.dumps(values["trace"])
        return self._submit(lambda conn: conn.execute(
            requests_table.update().where(requests_table.c.request_id == request_id).values(**values)))

    def flush(self, timeout: float | None = 30) -> None:
        """Blocks until everything queued so far is written."""
        self._submit(lambda conn: None).result(timeout)

    def close(self) -> None:
        """Writes what is queued, then stops the writer thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < 256:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            ops = [b for b in batch if b is not None]
            if ops:
                self._write(ops)
            if stop:
                return

    def _write(self, ops) -> None:
        try:
            with self.engine.begin() as conn:
                for op, _ in ops:
                    op(conn)
        except Exception as batch_error:
            # One bad row must not lose the others: retry each in its own transaction.
            log.warning("ledger batch of %d failed (%s); writing one by one", len(ops), batch_error)
            for op, fut in ops:
                try:
                    with self.engine.begin() as conn:
                        op(conn)
                    fut.set_result(None)
                except Exception as e:
                    log.error("ledger write failed: %s", e)
                    fut.set_exception(e)
            return
        for _, fut in ops:
            fut.set_result(None)

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
                    # Earlier requests with the same X-Request-ID: client retries.
                    out["retries"] = conn.execute(
                        sa.select(sa.func.count()).select_from(t).where(
                            t.c.x_request_id == out["x_request_id"],
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
          (still "running"), errors, prompt_tokens, cached_tokens,
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
            sa.func.sum(sa.case((t.c.status == "running", 1), else_=0)).label("incomplete"),
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
