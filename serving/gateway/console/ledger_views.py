"""The console's reads of the ledger: usage over time in buckets and one page of the request list.

Every query is bounded: a window of at most :data:`MAX_BUCKETS` buckets over ``created_at``
(indexed), at most :data:`MAX_GROUPS` groups a series (the rest summed as "other"), latency
percentiles over at most :data:`MAX_LATENCY_SAMPLES` rows (the newest of the range read), and list
pages of at most :data:`MAX_PAGE` rows found through indexed columns (``created_at``,
``request_id``, ``x_request_id``, ``tenant``, ``key_id``) with a cursor, never an offset.
:class:`OverviewReader` keeps the buckets that no longer change between reads, so a refreshed
overview reads only its newest minutes. All of it blocks on the database: call it from a worker
thread.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from typing import Callable, Sequence

import sqlalchemy as sa

from serving.gateway.accounts.database import requests as requests_table

STEPS = {"minute": 60, "hour": 3600, "day": 86400}
"""Bucket widths in seconds, by name."""
BY = {"model": "model", "tenant": "tenant", "key": "key_id", "service_tier": "service_tier"}
"""What a series may be split by: name -> ledger column."""
METRICS = ("requests", "prompt_tokens", "completion_tokens", "cost_usd", "errors")
MAX_BUCKETS = 500
MAX_GROUPS = 8
MAX_LATENCY_SAMPLES = 20_000
MAX_PAGE = 200
SETTLE_S = 300.0
"""A bucket that ended this many seconds ago, with no running row, no longer changes (but for late rows)."""
KEEP_S = 60.0
"""Seconds a settled bucket is kept before it is read again (what bounds a late row's delay)."""
PERCENTILES = (50, 90, 99)
LIST_COLUMNS = ("request_id", "x_request_id", "created_at", "status", "tenant", "key_id", "model",
                "service_tier", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd",
                "ttft_s", "e2e_s", "finish_reason", "trace")
"""What a list row shows (``trace`` only for its replica and region, dropped before returning)."""


def _bucket(column, step: int, dialect: str):
    """The start (Unix seconds) of the `step`-wide bucket holding `column`'s value."""
    if dialect == "postgresql":
        return sa.cast(sa.func.floor(column / step), sa.BigInteger) * step
    return sa.cast(column / step, sa.Integer) * step  # SQLite truncates; created_at is positive


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """The `p`-th percentile (0..100, nearest rank) of ascending `sorted_values`; None if empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclasses.dataclass
class _Bucket:
    """One bucket's sums per group, its latency percentiles and its rows still running."""

    groups: dict[str, list] = dataclasses.field(default_factory=dict)  # group -> values of METRICS
    latency: dict[str, float | None] = dataclasses.field(default_factory=dict)
    samples: int = 0
    running: int = 0


def _read_buckets(conn: sa.Connection, width: int, by: str, lo: int, hi: int) -> dict[int, _Bucket]:
    """The buckets of [lo, hi) that hold rows, read in two queries: sums per (bucket, group), and
    the newest :data:`MAX_LATENCY_SAMPLES` rows' TTFT and ITL for the percentiles."""
    t = requests_table
    col = t.c[BY[by]]
    window = sa.and_(t.c.created_at >= lo, t.c.created_at < hi)
    b = _bucket(t.c.created_at, width, conn.dialect.name).label("bucket")
    q = sa.select(
        b, col.label("grp"), sa.func.count().label("requests"),
        sa.func.coalesce(sa.func.sum(t.c.prompt_tokens), 0).label("prompt_tokens"),
        sa.func.coalesce(sa.func.sum(t.c.completion_tokens), 0).label("completion_tokens"),
        sa.func.coalesce(sa.func.sum(t.c.cost_usd), 0.0).label("cost_usd"),
        sa.func.sum(sa.case((t.c.status == "error", 1), else_=0)).label("errors"),
        sa.func.sum(sa.case((t.c.status == "running", 1), else_=0)).label("running"),
    ).where(window).group_by(b, col)
    out: dict[int, _Bucket] = {}
    for r in conn.execute(q).mappings():
        data = out.setdefault(int(r["bucket"]), _Bucket())
        g = "-" if r["grp"] is None else str(r["grp"])
        data.groups[g] = [float(r[m]) if m == "cost_usd" else int(r[m]) for m in METRICS]
        data.running += int(r["running"])
    # Plain DB-API tuples: no SQLAlchemy row objects for up to MAX_LATENCY_SAMPLES rows.
    lat = conn.execute(sa.select(t.c.created_at, t.c.ttft_s, t.c.itl_mean_s)
                       .where(window, t.c.ttft_s.is_not(None))
                       .order_by(t.c.created_at.desc()).limit(MAX_LATENCY_SAMPLES)).cursor.fetchall()
    values: dict[int, tuple[list, list]] = {}
    for created, ttft_s, itl_s in lat:
        ttft, itl = values.setdefault(int(created // width) * width, ([], []))
        ttft.append(ttft_s)
        if itl_s is not None:
            itl.append(itl_s)
    for start, (ttft, itl) in values.items():
        data = out.setdefault(start, _Bucket())
        data.samples = len(ttft)
        for name, v in (("ttft", ttft), ("itl", itl)):
            v.sort()
            for p in PERCENTILES:
                data.latency[f"{name}_p{p}"] = percentile(v, p)
    return out


class OverviewReader:
    """Usage over time from the ledger, keeping the settled buckets between reads.

    A bucket that ended at least `settle_s` seconds ago and held no "running" row when read is
    settled: it is kept `keep_s` seconds and not read again meanwhile, so a refresh reads only the
    newest minutes. A row written late into a settled bucket (a spool replayed after a database
    outage, another gateway's) shows once its bucket is read again, within `keep_s`.

    Args:
      engine: the ledger's database.
      settle_s, keep_s: seconds (keep_s 0: nothing kept, every read reads the whole window).
      clock: monotonic seconds, for `keep_s`.
    """

    def __init__(self, engine: sa.Engine, settle_s: float = SETTLE_S, keep_s: float = KEEP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.settle_s, self.keep_s, self.clock = engine, settle_s, keep_s, clock
        self._kept: dict[tuple[int, str], dict[int, tuple[float, _Bucket]]] = {}
        self._lock = threading.Lock()

    def read(self, end: float, step: str = "minute", buckets: int = 60, by: str = "model",
             now: float | None = None) -> dict:
        """Requests, tokens, cost and errors per bucket and group, and latency percentiles per bucket.

        Args:
          end: Unix seconds; the last bucket is the one holding `end`.
          step: a name of :data:`STEPS`.
          buckets: how many buckets, 1 to :data:`MAX_BUCKETS`.
          by: a name of :data:`BY`.
          now: Unix seconds now (default: the clock's), which decides what is settled.

        Returns:
          ``{"start", "end", "step" (seconds), "by", "buckets": [bucket starts], "totals": {metric:
          value}, "series": {metric: {group: [value per bucket]}}, "latency": {"ttft_p50", ...,
          "itl_p99": [seconds or None per bucket], "samples": rows read}, "buckets_read": how many
          buckets this read took from the database}``; errors are rows of status "error", groups
          beyond :data:`MAX_GROUPS` are summed as "other", a NULL group is "-".

        Raises:
          ValueError: an unknown `step` or `by`, or `buckets` out of range.
        """
        if step not in STEPS:
            raise ValueError(f"step must be one of {', '.join(STEPS)}; got {step!r}")
        if by not in BY:
            raise ValueError(f"by must be one of {', '.join(BY)}; got {by!r}")
        if not 1 <= buckets <= MAX_BUCKETS:
            raise ValueError(f"buckets must be between 1 and {MAX_BUCKETS}; got {buckets}")
        width = STEPS[step]
        last = int(end // width) * width
        starts = [last - (buckets - 1 - i) * width for i in range(buckets)]
        t = self.clock()
        with self._lock:
            kept = self._kept.setdefault((width, by), {})
            for b in [b for b, (at, _) in kept.items() if t - at >= self.keep_s]:
                del kept[b]
            have = {b: kept[b][1] for b in starts if b in kept}
        needed = [b for b in starts if b not in have]
        runs: list[list[int]] = []
        for b in needed:
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + width
            else:
                runs.append([b, b + width])
        if len(runs) > 4:  # many holes: one read from the first to the last
            runs = [[runs[0][0], runs[-1][1]]]
        fresh: dict[int, _Bucket] = {}
        if runs:
            with self.engine.connect() as conn:
                for lo, hi in runs:
                    fresh.update(_read_buckets(conn, width, by, lo, hi))
        wall = time.time() if now is None else now
        with self._lock:
            for b in needed:
                data = fresh.setdefault(b, _Bucket())
                if self.keep_s > 0 and b + width <= wall - self.settle_s and data.running == 0:
                    kept[b] = (t, data)
            while len(kept) > 2 * MAX_BUCKETS:
                del kept[next(iter(kept))]
        body = _assemble(starts, width, {**have, **fresh})
        return {"start": starts[0], "end": last + width, "step": width, "by": by, **body,
                "buckets_read": len(needed)}


def _assemble(starts: list[int], width: int, data: dict[int, _Bucket]) -> dict:
    """The series, totals and latency of `data`'s buckets, in the order of `starts`."""
    per_group: dict[str, int] = {}
    for b in starts:
        for g, v in data[b].groups.items():
            per_group[g] = per_group.get(g, 0) + v[0]
    # The groups with the most requests keep their own series; the rest are "other".
    kept = set(sorted(per_group, key=lambda g: (-per_group[g], g))[:MAX_GROUPS])
    series: dict[str, dict[str, list]] = {m: {} for m in METRICS}
    totals = {m: 0 for m in METRICS}
    for i, b in enumerate(starts):
        for g, v in data[b].groups.items():
            g = g if g in kept else "other"
            for m, x in zip(METRICS, v):
                values = series[m].setdefault(g, [0.0 if m == "cost_usd" else 0] * len(starts))
                values[i] += x
                totals[m] += x
    latency: dict[str, list | int] = {"samples": sum(data[b].samples for b in starts)}
    for name in ("ttft", "itl"):
        for p in PERCENTILES:
            latency[f"{name}_p{p}"] = [data[b].latency.get(f"{name}_p{p}") for b in starts]
    return {"buckets": starts, "totals": totals, "series": series, "latency": latency}


def usage_over_time(engine: sa.Engine, end: float, step: str = "minute", buckets: int = 60,
                    by: str = "model") -> dict:
    """One read of the whole window, nothing kept (:meth:`OverviewReader.read`'s result).

    Raises:
      ValueError: as :meth:`OverviewReader.read`.
    """
    return OverviewReader(engine, keep_s=0).read(end, step, buckets, by)


def request_page(engine: sa.Engine, limit: int = 50, after: str | None = None, q: str | None = None,
                 status: str | None = None, tenant: str | None = None, model: str | None = None,
                 key_id: str | None = None) -> tuple[list[dict], bool]:
    """One page of ledger rows, newest first.

    Args:
      limit: rows wanted, 1 to :data:`MAX_PAGE`.
      after: the request_id of the previous page's last row (None: the first page; an id no
        longer matching gives an empty page).
      q: a request id or an X-Request-ID (exact).
      status, tenant, model, key_id: only rows with this value.

    Returns:
      (rows with :data:`LIST_COLUMNS` less ``trace``, plus ``replica`` and ``region``; whether
      more follow).

    Raises:
      ValueError: `limit` out of range.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be between 1 and {MAX_PAGE}; got {limit}")
    t = requests_table
    conds = []
    if q:
        conds.append(sa.or_(t.c.request_id == q, t.c.x_request_id == q))
    for column, value in (("status", status), ("tenant", tenant), ("model", model), ("key_id", key_id)):
        if value:
            conds.append(t.c[column] == value)
    where = sa.and_(sa.true(), *conds)
    query = sa.select(*(t.c[c] for c in LIST_COLUMNS)).where(where)
    with engine.connect() as conn:
        if after is not None:
            mark = conn.execute(sa.select(t.c.created_at).where(where, t.c.request_id == after)).scalar()
            if mark is None:
                return [], False
            query = query.where(sa.or_(t.c.created_at < mark,
                                       sa.and_(t.c.created_at == mark, t.c.request_id < after)))
        rows = [dict(r) for r in conn.execute(
            query.order_by(t.c.created_at.desc(), t.c.request_id.desc()).limit(limit + 1)).mappings()]
    out = []
    for r in rows[:limit]:
        trace = r.pop("trace") or ""
        r["replica"], r["region"] = _trace_field(trace, "replica"), _trace_field(trace, "region")
        out.append(r)
    return out, len(rows) > limit


def _trace_field(trace: str, name: str) -> str | None:
    try:
        value = json.loads(trace).get(name) if trace else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
