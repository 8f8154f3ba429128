"""A request whose admission row could not be written is still served, so its completion must
write the whole row: every admitted request is metered once, whichever of its two writes failed.

A SQLite ledger in ``tmp_path`` refuses INSERTs while a flag is set (a SQLAlchemy event), as a
database refusing a write would; no server, no sleeps.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.accounts.pricing import PriceTable
from serving.gateway.accounts.rate_limit import RateLimiter
from serving.gateway.services.metering import Metering
from serving.gateway.services.metrics import GatewayMetrics
from serving.gateway.services.tracing import RequestTracer

pytestmark = pytest.mark.anyio


async def test_a_request_whose_admission_row_failed_is_metered_at_its_close(tmp_path):
    engine = open_database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    refuse = {"inserts": True}

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _refuse_inserts(conn, cursor, statement, params, context, executemany):
        if refuse["inserts"] and statement.lstrip().upper().startswith("INSERT"):
            raise RuntimeError("the database refused the insert")

    ledger = Ledger(engine)
    metering = Metering(ledger, PriceTable(models={}), GatewayMetrics(), RateLimiter(), RequestTracer(False))
    try:
        acme = Principal(tenant="acme", key_id="k1")
        meter = metering.admit(acme, "r1", "x1", "m", "normal", False, 1.7e9, prompt_tokens=4, max_tokens=8)
        ledger.flush()
        assert ledger.rows() == []  # the admission row was refused
        refuse["inserts"] = False
        meter.prefilled = True
        await meter.finish("ok", "stop", completion_tokens=5)
        [row] = ledger.rows()
        assert (row["request_id"], row["tenant"], row["key_id"], row["status"], row["finish_reason"]) == (
            "r1", "acme", "k1", "ok", "stop")
        assert (row["prompt_tokens"], row["completion_tokens"]) == (4, 5)
        # A completion whose row was written updates it, and inserts nothing more.
        other = metering.admit(acme, "r2", "x2", "m", "normal", False, 1.7e9 + 1, prompt_tokens=1, max_tokens=1)
        await other.finish("cancelled")
        assert [(r["request_id"], r["status"]) for r in ledger.rows()] == [("r1", "ok"), ("r2", "cancelled")]
    finally:
        ledger.close()
