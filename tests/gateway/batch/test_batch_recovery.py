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

import pytest
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


def _spooled_admission(directory, attempt: str, spool=None) -> None:
    """Appends to the spool in `directory` (or to `spool`) the admission row of `attempt`
    that a gateway wrote there while the database was away."""
    from serving.gateway.accounts.ledger_spool import LedgerSpool

    own = spool is not None
    spool = spool or LedgerSpool(directory, max_bytes=1 << 20)
    spool.append([{"op": "open", "row": dict(
        request_id=f"chatcmpl-{attempt}", x_request_id=attempt, model="m", priority="batch", stream=False,
        status="running", created_at=1.0, day="1970-01-01", gateway_instance=directory.name)}])
    if not own:
        spool.close()


def test_recovery_settles_the_spools_before_it_strikes_an_attempt(tmp_path):
    """Three lines left running by gateways whose admission rows are only in spools (the
    database was away): this gateway's own spool, a gone gateway's and a live one's. Before
    striking an attempt with no row, recovery replays what it can reach (so those attempts
    are cancelled, kept, and billed once) and leaves a line whose row a live gateway still
    spools alone (AttemptStillSpooled), until that gateway replays it."""
    from fastapi import FastAPI

    from serving.gateway.accounts.ledger_instances import GatewayInstance
    from serving.gateway.batch.batch_runner import install_batch_api
    from serving.gateway.batch.batches import AttemptStillSpooled
    from serving.gateway.services.gateway_services import GatewayServices

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    services = GatewayServices.open_server(url, ledger_spool_dir=str(tmp_path / "spool"))
    try:
        app = FastAPI()
        install_batch_api(app, services, {}, lambda: None, None)
        store, engine = app.state.batch_store, services.ledger.engine
        root = services.instance.directory.parent
        gone, live = GatewayInstance(root), GatewayInstance(root)
        f = app.state.file_store.create("t", "batch", "in.jsonl", (_line("a") + _line("b") + _line("c")).encode())
        batch_id = store.create("t", None, "/v1/chat/completions", f["file_id"], "24h", None)["batch_id"]
        assert store.claim(batch_id, "gw-x", 60)
        assert store.validate(batch_id, "gw-x", "/v1/chat/completions") == "in_progress"
        for line_no, (owner, attempt) in enumerate(
                ((services.instance, "req-own"), (gone, "req-gone"), (live, "req-live"))):
            store.start_attempt(batch_id, line_no, attempt)
            _spooled_admission(owner.directory, attempt, services.ledger.spool if owner is services.instance else None)
        gone.release(remove=False)  # it died with its spool unreplayed

        def lines():
            with engine.connect() as conn:
                return {r.line_no: (r.status, json.loads(r.attempts)) for r in conn.execute(
                    sa.select(batch_lines).where(batch_lines.c.batch_id == batch_id))}

        before = lines()
        with pytest.raises(AttemptStillSpooled, match="req-live"):
            store.recover_lines(batch_id)
        assert lines() == before  # nothing struck, nothing rerun yet
        ledger = Ledger(engine)
        for attempt in ("req-own", "req-gone"):  # replayed by the settling
            assert ledger.get(f"chatcmpl-{attempt}")["status"] in ("running", "interrupted")
        assert ledger.get("chatcmpl-req-live") is None

        live.release(remove=False)  # the live gateway goes too: now its spool is taken over
        assert store.recover_lines(batch_id) == 3
        assert lines() == {0: ("pending", ["req-own"]), 1: ("pending", ["req-gone"]),
                           2: ("pending", ["req-live"])}
        for attempt in ("req-own", "req-gone", "req-live"):
            row = ledger.get(f"chatcmpl-{attempt}")
            assert (row["status"], row["error"]) == ("cancelled", INTERRUPTED)
    finally:
        services.close()
