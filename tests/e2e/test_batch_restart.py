"""A batch survives its server: killed (SIGKILL) mid-batch and restarted on the same
database, the new process takes the lapsed lease and finishes the batch; every
``custom_id`` ends with exactly one ``ok`` ledger row and one output line, and the
attempts the crash interrupted are recorded ``cancelled``. Real ``xlaserve serve``
processes (tiny-random) and the official ``openai`` client."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import openai
import sqlalchemy as sa

from serving.gateway.accounts.database import batch_lines, open_database
from serving.gateway.accounts.ledger import Ledger
from tests.support.server_process import TINY_SERVER_ARGS, serve_process

LINES = 12
WAIT_S = 240  # the test's own bound on each wait below


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _wait(what: str, probe):
    deadline = time.time() + WAIT_S
    while True:
        value = probe()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _kill_while_an_attempt_runs(proc, db: str) -> None:
    """SIGKILLs the server at a moment when some batch attempt is admitted and unfinished
    (its ledger row committed as ``running``), so the kill is sure to interrupt one. The
    server is frozen (SIGSTOP) while the ledger is read, so what was read is what the
    kill meets; if no attempt runs, it is let go (SIGCONT) and probed again."""
    engine = open_database(db)
    requests = sa.Table("requests", sa.MetaData(), autoload_with=engine)
    try:
        deadline = time.time() + WAIT_S
        while True:
            os.kill(proc.pid, signal.SIGSTOP)
            with engine.connect() as conn:
                running = conn.execute(sa.select(sa.func.count()).select_from(requests).where(
                    requests.c.priority == "batch", requests.c.status == "running")).scalar_one()
            if running:
                proc.kill()  # SIGKILL: no drain, the lease is left to lapse
                proc.wait()
                return
            os.kill(proc.pid, signal.SIGCONT)
            assert time.time() < deadline, "timed out waiting for a running batch attempt"
            time.sleep(0.05)
    finally:
        engine.dispose()


def test_a_killed_server_resumes_its_batch_exactly_once(tmp_path):
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    args = [*TINY_SERVER_ARGS, "--database-url", db, "--batch-lease-seconds", "2",
            "--batch-concurrency", "2", "--skip-warmup"]
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "tiny-random", "max_tokens": 160, "temperature": 0,
                                         "ignore_eos": True,
                                         "messages": [{"role": "user", "content": f"count to {i}"}]}}) + "\n"
                    for i in range(LINES))
    with serve_process(args, tmp_path / "first.log") as (proc, url, _):
        client = _client(url)
        f = client.files.create(file=("lines.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        _wait("some lines done", lambda: 2 <= client.batches.retrieve(batch.id).request_counts.completed)
        _kill_while_an_attempt_runs(proc, db)
    engine = open_database(db)
    with engine.connect() as conn:
        done_before = conn.execute(sa.select(sa.func.count()).select_from(batch_lines).where(
            batch_lines.c.batch_id == batch.id, batch_lines.c.status != "running",
            batch_lines.c.status != "pending")).scalar_one()
    assert done_before < LINES, "the batch finished before the kill: nothing to resume"

    with serve_process(args, tmp_path / "second.log") as (_, url, _):
        client = _client(url)
        final = _wait("the batch completed", lambda: (
            b if (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") else None))
        assert final.status == "completed", final
        assert (final.request_counts.completed, final.request_counts.failed) == (LINES, 0)
        out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]

    assert sorted(o["custom_id"] for o in out) == sorted(f"line-{i}" for i in range(LINES))
    assert all(o["response"]["status_code"] == 200 for o in out)
    rows = {r["x_request_id"]: r for r in Ledger(engine).rows()}
    with engine.connect() as conn:
        attempts = {r.custom_id: json.loads(r.attempts) for r in conn.execute(
            sa.select(batch_lines.c.custom_id, batch_lines.c.attempts).where(batch_lines.c.batch_id == batch.id))}
    interrupted = 0
    for custom_id, ids in attempts.items():
        statuses = [rows[a]["status"] for a in ids]
        assert statuses.count("ok") == 1, (custom_id, statuses)
        assert set(statuses) <= {"ok", "cancelled"}, (custom_id, statuses)
        interrupted += statuses.count("cancelled")
        assert all(rows[a]["priority"] == "batch" for a in ids)
    assert not [r for r in rows.values() if r["status"] == "running"]
    assert interrupted >= 1, "no attempt was interrupted by the kill"
