"""A gateway instance's start and clean stop: its own rows still running at a clean shutdown
are marked "interrupted" before its directory goes, and a directory another gateway is still
creating (no lock file yet) is never taken over.

SQLite ledgers and spool directories in ``tmp_path``; no server process.
"""

from __future__ import annotations

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.accounts.ledger_instances import GatewayInstance, database_key, take_over_gone_instances
from serving.gateway.accounts.ledger_spool import LedgerSpool
from serving.gateway.services.gateway_services import GatewayServices


def test_a_clean_shutdown_marks_its_own_running_rows_interrupted(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    services = GatewayServices.open_server(database_url=url, ledger_spool_dir=str(tmp_path / "spool"))
    acme = Principal(tenant="acme", key_id=None)
    services.metering.admit(acme, "cut", "x1", "m", "normal", True, 1.7e9, prompt_tokens=3, max_tokens=4)
    instance = services.instance
    services.ledger.flush()
    services.close()  # the stream was cut at the drain timeout: its row is still "running"
    [row] = Ledger(open_database(url)).rows()
    assert (row["request_id"], row["status"], row["gateway_instance"]) == ("cut", "interrupted", instance.id)
    assert row["finished_at"] is not None and instance.id in row["error"]
    assert not instance.directory.exists()


def test_a_directory_without_a_lock_file_is_never_taken_over(tmp_path):
    engine = open_database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    root = tmp_path / "spool" / database_key(engine)
    creating = root / "gw-0123456789ab"  # another gateway between its mkdir and its lock
    creating.mkdir(parents=True)
    spool = LedgerSpool(creating, max_bytes=1 << 20)
    spool.append([{"op": "open", "row": dict(request_id="r1", model="m", priority="normal", stream=False,
                                             status="running", created_at=1.7e9, day="2023-11-14")}])
    spool.close()
    ours = GatewayInstance(root)
    try:
        assert (ours.directory / "lock").exists()
        assert take_over_gone_instances(root, engine, ours.id) == []
        assert (creating / "spool.jsonl").exists() and not (creating / "lock").exists()
        assert Ledger(engine).rows() == []
    finally:
        ours.release(remove=True)
