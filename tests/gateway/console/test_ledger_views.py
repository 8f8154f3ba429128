"""OverviewReader keeps settled buckets between reads and reads the rest again: what it shows
equals a read of the whole window, but for late rows in a kept bucket until it is read again."""

from __future__ import annotations

import time

import pytest

from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.console.ledger_views import KEEP_S, SETTLE_S, OverviewReader, usage_over_time
from tests.support.console_ledger import fill_ledger


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(open_database(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    yield led
    led.close()


def row(i: int, created: float, status: str = "running") -> dict:
    return {"request_id": f"late-{i}", "model": "m", "priority": "normal", "stream": False, "status": status,
            "created_at": created, "tenant": "acme"}


def without_reads(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "buckets_read"}


def test_settled_buckets_are_kept_and_late_rows_show_once_read_again(ledger):
    now = time.time()
    fill_ledger(ledger, now, n=30)  # rows every 50 s over the last 25 minutes
    clock = Clock()
    reader = OverviewReader(ledger.engine, clock=clock)
    first = reader.read(now, now=now)
    assert first["buckets_read"] == 60
    assert without_reads(first) == without_reads(usage_over_time(ledger.engine, now))
    again = reader.read(now, now=now)
    recent = sum(b + 60 > now - SETTLE_S for b in first["buckets"])
    assert again["buckets_read"] == recent == 6 - (now % 60 == 0)  # ended under 5 min ago: not settled
    assert without_reads(again) == without_reads(first)
    # A row written late into a settled bucket: not shown until that bucket is read again.
    ledger.open_row(row(1, now - 1200, status="ok"))
    ledger.flush()
    assert reader.read(now, now=now)["totals"]["requests"] == 30
    clock.t += KEEP_S
    late = reader.read(now, now=now)
    assert late["totals"]["requests"] == 31 and late["buckets_read"] == 60


def test_a_bucket_with_a_running_row_is_read_until_it_finishes(ledger):
    now = time.time()
    ledger.open_row(row(2, now - 1800))  # still running, half an hour on
    ledger.flush()
    reader = OverviewReader(ledger.engine, clock=Clock())
    assert reader.read(now, now=now)["totals"]["completion_tokens"] == 0
    ledger.close_row("late-2", {"status": "ok", "completion_tokens": 42, "prompt_tokens": 7})
    ledger.flush()
    done = reader.read(now, now=now)
    assert done["totals"]["completion_tokens"] == 42 and done["totals"]["prompt_tokens"] == 7
    assert reader.read(now, now=now)["buckets_read"] == sum(b + 60 > now - SETTLE_S for b in done["buckets"])
