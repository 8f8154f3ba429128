"""Recovering the lines a stopped gateway left running, on the store itself.

A gateway killed mid-batch leaves lines ``running``. Some of their attempts
reached admission (a ledger row exists, "running"), some were killed between
recording the attempt and admitting it (no row). After recovery every line is
pending again, every admitted attempt's row says why it ended, and the line's
attempts name only requests the ledger knows, so an audit never meets an id
that nothing metered.
"""

from __future__ import annotations

import json

import sqlalchemy as sa

from serving.gateway.accounts.database import batch_lines, open_database
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.batch.batches import INTERRUPTED, BatchStore
from serving.gateway.batch.files import FileStore


def _line(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}) + "\n"


def test_recovery_cancels_admitted_attempts_and_strikes_unadmitted_ones(tmp_path):
    engine = open_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    files = FileStore(engine)
    store = BatchStore(engine, files)
    f = files.create("t", "batch", "in.jsonl", (_line("a") + _line("b") + _line("c")).encode())
    batch_id = store.create("t", None, "/v1/chat/completions", f["file_id"], "24h", None)["batch_id"]
    assert store.claim(batch_id, "gw-1", 60)
    assert store.validate(batch_id, "gw-1", "/v1/chat/completions") == "in_progress"

    store.start_attempt(batch_id, 0, "req-admitted")
    store.start_attempt(batch_id, 1, "req-never-admitted")
    ledger = Ledger(engine)
    ledger.open_row(dict(request_id="chatcmpl-1", x_request_id="req-admitted", model="m", priority="batch",
                         stream=False, status="running", created_at=1.0)).result(timeout=30)
    ledger.close()

    assert store.recover_lines(batch_id) == 2

    with engine.connect() as conn:
        lines = {r.line_no: r for r in conn.execute(
            sa.select(batch_lines).where(batch_lines.c.batch_id == batch_id))}
    assert [lines[i].status for i in range(3)] == ["pending"] * 3
    assert [json.loads(lines[i].attempts) for i in range(3)] == [["req-admitted"], [], []]
    row = Ledger(engine).get("chatcmpl-1")
    assert (row["status"], row["error"]) == ("cancelled", INTERRUPTED)


def test_an_attempt_reconciled_as_interrupted_at_start_up_is_still_cancelled(tmp_path):
    # A restarted gateway marks a dead instance's running rows "interrupted" before its
    # batch runner recovers the lines (ledger_instances.py): the batch's own reason wins.
    from serving.gateway.accounts.ledger_instances import mark_interrupted

    engine = open_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    files = FileStore(engine)
    store = BatchStore(engine, files)
    f = files.create("t", "batch", "in.jsonl", _line("a").encode())
    batch_id = store.create("t", None, "/v1/chat/completions", f["file_id"], "24h", None)["batch_id"]
    assert store.claim(batch_id, "gw-1", 60)
    assert store.validate(batch_id, "gw-1", "/v1/chat/completions") == "in_progress"
    store.start_attempt(batch_id, 0, "req-a")
    ledger = Ledger(engine, instance="gw-dead")
    ledger.open_row(dict(request_id="chatcmpl-a", x_request_id="req-a", model="m", priority="batch",
                         stream=False, status="running", created_at=1.0)).result(timeout=30)
    ledger.close()
    assert mark_interrupted(engine, "gw-dead", "gw-new") == 1

    assert store.recover_lines(batch_id) == 1
    row = Ledger(engine).get("chatcmpl-a")
    assert (row["status"], row["error"]) == ("cancelled", INTERRUPTED)
