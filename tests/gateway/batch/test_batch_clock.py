"""Batch leases go by the database's clock, not each gateway's: a gateway whose clock runs 20 s
ahead cannot take a lease another gateway holds and renews, and gateways left to their defaults
time batches by the database's clock too. Two BatchStores over one SQLite file; no runner."""

from __future__ import annotations

import time

from serving.gateway.accounts.database import open_database
from serving.gateway.batch.batch_runner import BatchSettings
from serving.gateway.batch.batches import BatchStore
from serving.gateway.batch.files import FileStore


def test_a_gateway_whose_clock_runs_ahead_cannot_take_a_live_lease(tmp_path):
    engine = open_database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    ours = BatchStore(engine, FileStore(engine))
    ahead = BatchStore(engine, FileStore(engine), clock=lambda: time.time() + 20)
    file_id = ours.files.create("acme", "batch", "in.jsonl", b"{}\n")["file_id"]
    batch = ours.create("acme", None, "/v1/chat/completions", file_id, "24h", None)
    assert ours.claim(batch["batch_id"], "gw-a", lease_s=10)
    assert not ahead.claim(batch["batch_id"], "gw-b", lease_s=10)  # 10 s left by the database's clock
    assert batch["batch_id"] not in ahead.claimable()
    assert ours.renew(batch["batch_id"], "gw-a", lease_s=10)["lease_owner"] == "gw-a"
    assert BatchSettings().clock is None  # the runner's default: the database's clock
