"""The ledger spool under faults: an append cut short by the file-size limit (``EFBIG``) is
rolled back for real, so the spool's size and record count equal what the file holds, and a
corrupt complete line is quarantined and counted instead of failing every replay.

No database process and no gateway: the spool file and a SQLite ledger in ``tmp_path``.
"""

from __future__ import annotations

import pytest

from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.accounts.ledger_spool import SPOOL_FILE, LedgerSpool
from serving.gateway.services.metrics import GatewayMetrics
from tests.support.disk_full import file_size_limit


def _open(i: int, pad: int = 0) -> dict:
    return {"op": "open", "row": dict(request_id=f"r{i}", model="m" + "x" * pad, priority="normal",
                                      stream=False, status="running", created_at=1.7e9 + i, day="2023-11-14")}


def _lines(path) -> int:
    return path.read_bytes().count(b"\n")


def test_an_append_cut_short_by_efbig_is_rolled_back_and_the_counts_follow_the_file(tmp_path):
    spool = LedgerSpool(tmp_path, max_bytes=1 << 30)
    spool.append([_open(1)])
    path = tmp_path / SPOOL_FILE
    size = path.stat().st_size
    with file_size_limit(size + 100), pytest.raises(OSError):
        spool.append([_open(2, pad=2_000)])  # partly written, then EFBIG
    assert path.stat().st_size == size
    spool.append([_open(3)])
    assert spool.size_bytes == path.stat().st_size
    assert spool.depth_records == _lines(path) == 2
    assert [r["row"]["request_id"] for _, r in spool.read(10)] == ["r1", "r3"]
    spool.close()
    reopened = LedgerSpool(tmp_path, max_bytes=1 << 30)
    assert (reopened.depth_records, reopened.size_bytes) == (2, path.stat().st_size)
    reopened.close()


def test_a_corrupt_line_is_quarantined_counted_and_the_rest_replayed(tmp_path):
    spool = LedgerSpool(tmp_path / "spool", max_bytes=1 << 30)
    spool.append([_open(1)])
    spool.close()
    with open(tmp_path / "spool" / SPOOL_FILE, "ab") as f:  # a whole line of garbage mid-spool
        f.write(b"\x00\x17garbage{\n")
    spool = LedgerSpool(tmp_path / "spool", max_bytes=1 << 30)
    spool.append([_open(2)])
    with open(tmp_path / "spool" / SPOOL_FILE, "ab") as f:
        f.write(b"[1, 2]\n")  # JSON, but no record
    spool.close()
    spool = LedgerSpool(tmp_path / "spool", max_bytes=1 << 30)
    assert spool.depth_records == 4
    engine = open_database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    ledger = Ledger(engine, spool=spool)
    metrics = GatewayMetrics()
    metrics.watch_ledger(ledger)
    try:
        ledger.close()  # its writer replays the spool (all of it, when closing)
        assert (spool.depth_records, spool.size_bytes, spool.quarantined) == (0, 0, 2)
        assert {r["request_id"] for r in ledger.rows()} == {"r1", "r2"}
        assert (tmp_path / "spool" / "quarantine.jsonl").read_bytes() == b"\x00\x17garbage{\n[1, 2]\n"
        assert metrics.registry.get_sample_value("xlaserve:ledger_spool_quarantined_total") == 2
    finally:
        ledger.close()
        spool.close()
