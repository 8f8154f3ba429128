"""Storage quotas, file expiry and a full disk (issue 44, item 2).

One tenant's uploads against its quotas, on a database whose file cannot grow past a
file-size limit (RLIMIT_FSIZE, standing in for a small disk), while another tenant's
completions go on and are metered; ``expires_after`` on uploads and batch outputs; the
ledger telling a full database from an unreachable one; the spool's start-up check.
"""

from __future__ import annotations

import httpx
import pytest
import sqlalchemy as sa

from serving.gateway.accounts.api_keys import Quotas
from serving.gateway.accounts.database import files as files_table
from tests.gateway.batch.test_batches import MODEL, batch_in, chat_line, client, gateway, jsonl, read_lines, until
from tests.support.disk_full import file_size_limit

pytestmark = pytest.mark.anyio


def _http(app, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                             headers={"Authorization": f"Bearer {key}"})


async def _upload(http: httpx.AsyncClient, nbytes: int, **form) -> httpx.Response:
    return await http.post("/v1/files", data={"purpose": "batch", **form},
                           files={"file": ("in.jsonl", b"x" * nbytes)})


async def test_a_tenant_over_its_quotas_is_refused_by_name_while_another_is_served_and_metered(tmp_path):
    async with gateway(tmp_path) as (app, services):
        keys = services.authenticator.key_store
        bomber, _ = keys.create_key("bomber")
        unbounded, _ = keys.create_key("unbounded")
        victim, _ = keys.create_key("victim")
        keys.set_tenant("bomber", quotas=Quotas(file_bytes=200_000, files=2))
        db_file = tmp_path / "ledger.db"
        victim_oai = client(app, victim)

        async def victim_chat(i: int):
            r = await victim_oai.chat.completions.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": f"hi {i}"}])
            return r.usage.completion_tokens

        served = [await victim_chat(0)]
        async with _http(app, bomber) as b, _http(app, unbounded) as u:
            # The disk: the database's file (and its journal) may grow by 600 kB.
            with file_size_limit(db_file.stat().st_size + 600_000):
                assert (await _upload(b, 150_000)).status_code == 200
                over = await _upload(b, 150_000)  # 300 kB stored with it: over file_bytes
                alone = await _upload(b, 300_000)  # larger than the quota on its own
                assert (await _upload(b, 10_000)).status_code == 200
                count = await _upload(b, 10)  # a third file
                served.append(await victim_chat(1))
                full = await _upload(u, 1_000_000)  # no quota: the disk refuses it
                served.append(await victim_chat(2))
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        assert over.json()["error"]["param"] == "file_bytes" and "file_bytes quota" in over.json()["error"]["message"]
        assert alone.status_code == 413 and alone.json()["error"]["param"] == "file_bytes"
        assert count.status_code == 429 and count.json()["error"]["param"] == "files"
        assert full.status_code == 507 and full.json()["error"]["code"] == "storage_full"
        # Every victim request was served and metered once, with its tokens.
        assert services.ledger.settle(10)  # what the full disk made it spool, replayed
        rows = services.ledger.rows(tenant="victim")
        assert [(r["status"], r["completion_tokens"]) for r in rows] == [("ok", n) for n in served]
        assert services.ledger.spooled_records == 0 and services.ledger.admitting
        with services.ledger.engine.connect() as conn:
            stored = conn.execute(sa.select(files_table.c.tenant, files_table.c.bytes)).all()
        assert sorted(stored) == [("bomber", 10_000), ("bomber", 150_000)]


async def test_files_and_batch_outputs_expire_and_are_swept(tmp_path):
    from tests.gateway.batch.test_batches import Clock

    clock = Clock()
    async with gateway(tmp_path, clock=clock) as (app, services):
        oai = client(app)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as h:
            r = await _upload(h, 10, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"})
            assert r.status_code == 200 and r.json()["expires_at"] == r.json()["created_at"] + 3600
            short = await _upload(h, 10, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"})
            assert short.status_code == 400 and short.json()["error"]["param"] == "expires_after"
            f = await oai.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
            b = await h.post("/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h",
                                                  "output_expires_after": {"anchor": "created_at", "seconds": 7200}})
            assert b.status_code == 200, b.text
            done = await batch_in(oai, b.json()["id"], "completed")
            out = await oai.files.retrieve(done.output_file_id)
            assert out.expires_at == out.created_at + 7200
            assert [x["custom_id"] for x in await read_lines(oai, done.output_file_id)] == ["a"]
            clock.t += 3601  # the upload expired, the batch output not yet
            assert (await h.get(f"/v1/files/{r.json()['id']}")).status_code == 404
            assert (await h.get(f"/v1/files/{r.json()['id']}/content")).status_code == 404
            assert (await h.get(f"/v1/files/{done.output_file_id}")).status_code == 200
            engine = services.ledger.engine

            async def swept():  # the runner's poll deletes the expired row
                with engine.connect() as conn:
                    return conn.execute(sa.select(sa.func.count()).select_from(files_table).where(
                        files_table.c.file_id == r.json()["id"])).scalar_one() == 0

            await until(swept, "the sweep")
            clock.t += 3600
            assert (await h.get(f"/v1/files/{done.output_file_id}")).status_code == 404
            listed = (await h.get("/v1/files")).json()["data"]
            assert [x["id"] for x in listed] == [f.id]


async def test_a_tenant_over_its_batch_quota_gets_a_429_naming_it(tmp_path):
    from tests.gateway.batch.test_batches import GatedEngine

    engine = GatedEngine(text="Hello world")
    async with gateway(tmp_path, engine) as (app, services):
        keys = services.authenticator.key_store
        key, _ = keys.create_key("t")
        keys.set_tenant("t", quotas=Quotas(batches=1))
        oai = client(app, key)
        async with _http(app, key) as h:
            f = (await h.post("/v1/files", data={"purpose": "batch"},
                              files={"file": ("in.jsonl", jsonl([chat_line("a")]))})).json()["id"]
            body = {"input_file_id": f, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            first = await h.post("/v1/batches", json=body)
            second = await h.post("/v1/batches", json=body)  # the first is unfinished (its line waits)
            assert first.status_code == 200 and second.status_code == 429, second.text
            assert second.json()["error"]["param"] == "batches" and "batches quota" in second.json()["error"]["message"]
            engine.gate.set()
            await batch_in(oai, first.json()["id"], "completed")
            assert (await h.post("/v1/batches", json=body)).status_code == 200  # room again


def test_the_ledger_tells_a_full_database_from_an_unreachable_one(tmp_path):
    """Writes the database refuses for full storage go to the spool (nothing lost), counted
    as such; the gateway keeps admitting while the spool takes them; once space is back the
    spool is replayed."""
    from serving.gateway.accounts.database import is_disk_full, is_unreachable, open_database
    from serving.gateway.accounts.ledger import Ledger
    from serving.gateway.accounts.ledger_spool import LedgerSpool

    (tmp_path / "db").mkdir()
    engine = open_database(f"sqlite:///{tmp_path / 'db' / 'ledger.db'}")
    spool = LedgerSpool(tmp_path / "spool", max_bytes=1 << 20)
    ledger = Ledger(engine, spool=spool, retry_s=0.05)
    db = tmp_path / "db" / "ledger.db"
    with engine.begin() as conn:  # the database's files fill the disk but for 10 kB
        conn.execute(sa.text("CREATE TABLE filler (x BLOB)"))
        conn.execute(sa.text("INSERT INTO filler VALUES (zeroblob(300000))"))
    limit = max(p.stat().st_size for p in db.parent.iterdir()) + 10_000
    try:
        with file_size_limit(limit):
            for i in range(3):  # rows of 20 kB: the database cannot take them, the spool can
                ledger.open_row(dict(request_id=f"r{i}", model="m", priority="default", stream=False,
                                     status="running", created_at=1.0, trace={"pad": "x" * 20_000})).result(timeout=30)
            assert ledger.database_full and ledger.database_full_writes >= 1
            assert spool.depth_records == 3 and ledger.admitting
            with pytest.raises(sa.exc.OperationalError) as refused:
                with engine.begin() as conn:
                    conn.execute(sa.text("INSERT INTO filler VALUES (zeroblob(100000))"))
            assert is_disk_full(refused.value) and not is_unreachable(refused.value)
        assert ledger.settle(10)
        assert not ledger.database_full and [r["request_id"] for r in ledger.rows()] == ["r0", "r1", "r2"]
    finally:
        ledger.close()
        spool.close()


def test_the_spool_refuses_a_filesystem_without_room_and_says_when_it_shares_the_database(tmp_path, caplog):
    from serving.gateway.accounts.database import open_database
    from serving.gateway.accounts.ledger_instances import check_spool_filesystem, free_bytes, open_durable_ledger

    engine = open_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    with pytest.raises(OSError, match="--ledger-spool-max-bytes"):
        open_durable_ledger(engine, tmp_path / "spool", spool_max_bytes=free_bytes(tmp_path) * 2)
    assert not any(p.name.startswith("gw-") for p in (tmp_path / "spool").rglob("gw-*"))  # nothing left behind
    with caplog.at_level("WARNING", logger="xlaserve.ledger"):
        assert check_spool_filesystem(tmp_path, engine, 1)
    assert "filesystem of the SQLite database" in caplog.text
    ledger, instance = open_durable_ledger(engine, tmp_path / "spool", spool_max_bytes=1 << 20)
    try:
        from serving.gateway.services.metrics import GatewayMetrics

        metrics = GatewayMetrics()
        metrics.watch_ledger(ledger)
        get = metrics.registry.get_sample_value
        assert get("xlaserve:ledger_spool_shares_database_filesystem") == 1.0
        assert get("xlaserve:ledger_database_full") == 0.0
        assert get("xlaserve:ledger_spool_free_bytes") > 0
        assert get("xlaserve:ledger_database_full_writes_total") == 0.0
    finally:
        ledger.close()
        ledger.spool.close()
        instance.release(remove=True)


def test_a_refused_tenant_costs_the_database_one_query_a_second(tmp_path, monkeypatch):
    """An upload refused for its quota (429) answers the tenant's next uploads of at least its
    size for ``QUOTA_REFUSAL_S`` without a query (the hostile tenant's uploads, ~100 a second,
    queried the database each, beside every tenant's metering writes); a smaller upload, a
    deleted file and the second's end each ask the database again."""
    from serving.gateway.accounts.database import open_database
    from serving.gateway.batch import files as files_module
    from serving.gateway.http.errors import OpenAIError

    engine = open_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    queries = []
    sa.event.listen(engine, "before_cursor_execute", lambda *a, **k: queries.append(a[2]))
    store = files_module.FileStore(engine, quotas=lambda tenant: Quotas(file_bytes=1000, files=None))
    kept = store.create("bomber", "batch", "a.jsonl", b"x" * 900, check_quota=True)

    def refused(size: int) -> int:
        """The queries one pre-check made; it must be refused with the quota named."""
        before = len(queries)
        with pytest.raises(OpenAIError) as e:
            store.check_quota("bomber", size)
        assert e.value.status_code == 429 and e.value.param == "file_bytes"
        assert e.value.headers["Retry-After"] == "1"
        return len(queries) - before

    assert refused(500) == 1  # its use (this test's quotas come from a function, not the database)
    assert refused(500) == 0 and refused(800) == 0  # remembered: no query
    before = len(queries)
    store.check_quota("bomber", 50)  # smaller than the refused one: asked, and it fits
    assert len(queries) > before
    store.check_quota("victim", 500)  # another tenant is never answered from the bomber's refusal
    assert store.delete(kept["file_id"], "bomber")
    store.check_quota("bomber", 500)  # room again: asked, fits
    store.create("bomber", "batch", "b.jsonl", b"x" * 900, check_quota=True)
    with pytest.raises(OpenAIError) as alone:  # alone over the byte quota: still its 413
        store.check_quota("bomber", 5000)
    assert alone.value.status_code == 413
    monkeypatch.setattr(files_module, "QUOTA_REFUSAL_S", 0.0)
    assert refused(500) == 1  # a refusal kept for no time: asked each time
    assert refused(500) == 1


async def test_uploads_sent_within_a_refusals_retry_after_wait_it_out_without_a_worker_thread(tmp_path, monkeypatch):
    """A tenant refused for its quota that sends more uploads before the refusal's Retry-After
    (the hostile tenant: ~100 refused 1 MB uploads a second, each read to its end after its
    429) has them answered from the remembered refusal on the event loop, no worker thread,
    once that second is over: its uploads come at most about once a second a connection. A
    tenant that waits its Retry-After, and another tenant, are not held."""
    import time

    from serving.gateway.batch import files as files_module

    monkeypatch.setattr(files_module, "QUOTA_REFUSAL_S", 0.4)
    checks, ends = [], []  # the tenants asked; when each remembered refusal runs out (monotonic)
    check_quota = files_module.FileStore.check_quota
    monkeypatch.setattr(files_module.FileStore, "check_quota",
                        lambda self, tenant, at_least: (checks.append(tenant), check_quota(self, tenant, at_least)))
    remembered_refusal = files_module.FileStore.remembered_refusal

    def remembered(self, tenant, at_least):
        refusal = remembered_refusal(self, tenant, at_least)
        if refusal is not None:
            ends.append(time.monotonic() + refusal[0])
        return refusal

    monkeypatch.setattr(files_module.FileStore, "remembered_refusal", remembered)
    async with gateway(tmp_path) as (app, services):
        keys = services.authenticator.key_store
        bomber, _ = keys.create_key("bomber")
        other, _ = keys.create_key("other")
        keys.set_tenant("bomber", quotas=Quotas(files=1))
        async with _http(app, bomber) as b, _http(app, other) as o:
            assert (await _upload(b, 10)).status_code == 200
            first = await _upload(b, 10)
            assert first.status_code == 429 and first.headers["Retry-After"] == "1"
            assert checks == ["bomber", "bomber"]
            again = await _upload(b, 10)
            answered = time.monotonic()
            assert again.status_code == 429 and again.json()["error"]["code"] == "quota_exceeded"
            assert again.json()["error"]["param"] == "files" and again.headers["Retry-After"] == "1"
            assert checks == ["bomber", "bomber"]  # answered on the loop, from the refusal
            assert len(ends) == 1 and answered >= ends[0]  # held to the refusal's end, not answered at once
            assert (await _upload(o, 10)).status_code == 200  # another tenant: asked, not held
            assert checks == ["bomber", "bomber", "other"]
            late = await _upload(b, 10)  # past the refusal: asked again (and still over)
            assert late.status_code == 429 and checks == ["bomber", "bomber", "other", "bomber"]
