"""The console's reads of the ledger: usage over time in buckets and one page of the request list.

Every query is bounded: a window of at most :data:`MAX_BUCKETS` buckets over ``created_at``
(indexed), at most :data:`MAX_GROUPS` groups a series (the rest summed as "other"), latency
percentiles over at most :data:`MAX_LATENCY_SAMPLES` rows (the newest of the window), and list
pages of at most :data:`MAX_PAGE` rows found through indexed columns (``created_at``,
``request_id``, ``x_request_id``, ``tenant``, ``key_id``) with a cursor, never an offset. All of
it blocks on the database: call it from a worker thread.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

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


def usage_over_time(engine: sa.Engine, end: float, step: str = "minute", buckets: int = 60,
                    by: str = "model") -> dict:
    """Requests, tokens, cost and errors per bucket and group, and latency percentiles per bucket.

    Args:
      end: Unix seconds; the last bucket is the one holding `end`.
      step: a name of :data:`STEPS`.
      buckets: how many buckets, 1 to :data:`MAX_BUCKETS`.
      by: a name of :data:`BY`.

    Returns:
      ``{"start", "end", "step" (seconds), "by", "buckets": [bucket starts], "totals": {metric:
      value}, "series": {metric: {group: [value per bucket]}}, "latency": {"ttft_p50", ...,
      "itl_p99": [seconds or None per bucket], "samples": rows read}}``; errors are rows of status
      "error", groups beyond :data:`MAX_GROUPS` are summed as "other", a NULL group is "-".

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
    start = last - (buckets - 1) * width
    stop = last + width
    starts = [start + i * width for i in range(buckets)]
    index = {b: i for i, b in enumerate(starts)}
    t = requests_table
    col = t.c[BY[by]]
    window = sa.and_(t.c.created_at >= start, t.c.created_at < stop)
    with engine.connect() as conn:
        b = _bucket(t.c.created_at, width, conn.dialect.name).label("bucket")
        q = sa.select(
            b, col.label("grp"), sa.func.count().label("requests"),
            sa.func.coalesce(sa.func.sum(t.c.prompt_tokens), 0).label("prompt_tokens"),
            sa.func.coalesce(sa.func.sum(t.c.completion_tokens), 0).label("completion_tokens"),
            sa.func.coalesce(sa.func.sum(t.c.cost_usd), 0.0).label("cost_usd"),
            sa.func.sum(sa.case((t.c.status == "error", 1), else_=0)).label("errors"),
        ).where(window).group_by(b, col)
        grouped = [dict(r) for r in conn.execute(q).mappings()]
        # Plain DB-API tuples: no SQLAlchemy row objects for up to MAX_LATENCY_SAMPLES rows.
        lat = conn.execute(
            sa.select(t.c.created_at, t.c.ttft_s, t.c.itl_mean_s)
            .where(window, t.c.ttft_s.is_not(None))
            .order_by(t.c.created_at.desc()).limit(MAX_LATENCY_SAMPLES)).cursor.fetchall()
    # The groups with the most requests keep their own series; the rest are "other".
    per_group: dict[str, int] = {}
    for r in grouped:
        g = "-" if r["grp"] is None else str(r["grp"])
        per_group[g] = per_group.get(g, 0) + int(r["requests"])
    kept = set(sorted(per_group, key=lambda g: (-per_group[g], g))[:MAX_GROUPS])
    series: dict[str, dict[str, list]] = {m: {} for m in METRICS}
    totals = {m: 0 for m in METRICS}
    for r in grouped:
        i = index.get(int(r["bucket"]))
        if i is None:
            continue
        g = "-" if r["grp"] is None else str(r["grp"])
        g = g if g in kept else "other"
        for m in METRICS:
            v = float(r[m]) if m == "cost_usd" else int(r[m])
            values = series[m].setdefault(g, [0.0 if m == "cost_usd" else 0] * buckets)
            values[i] += v
            totals[m] += v
    ttft: list[list[float]] = [[] for _ in starts]
    itl: list[list[float]] = [[] for _ in starts]
    for created, ttft_s, itl_s in lat:
        i = int(created // width) - start // width
        if 0 <= i < buckets:
            ttft[i].append(ttft_s)
            if itl_s is not None:
                itl[i].append(itl_s)
    latency: dict[str, list | int] = {"samples": len(lat)}
    for name, values in (("ttft", ttft), ("itl", itl)):
        for v in values:
            v.sort()
        for p in PERCENTILES:
            latency[f"{name}_p{p}"] = [percentile(v, p) for v in values]
    return {"start": start, "end": stop, "step": width, "by": by, "buckets": starts,
            "totals": totals, "series": series, "latency": latency}


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
