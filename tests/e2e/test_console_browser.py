"""The console in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright's
Python package through ``executable_path``; no browser is downloaded) against one
``xlaserve serve --model tiny-random`` process (the shared tiny server's arguments, so no new
shapes compile) whose SQLite ledger the test filled before it started.

In file order: log in with an admin key and read the overview's totals and charts (equal to
the filled ledger's sums), open a request's trace, create and revoke a key (the revoked key is
then refused by the API), stream a playground reply and follow its trace link. Each page's
screenshot is saved under the test run's temporary directory (the path is printed; ``-s``
shows it). A machine without Chromium fails here, saying how to install it (``.ci/run`` does).
"""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from serving.gateway.accounts.api_keys import KeyStore
from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.ledger import Ledger
from tests.support.console_ledger import fill_ledger, sums
from tests.support.server_process import TINY_SERVER_ARGS, serve_process

CHROMIUM_ENV = "XLASERVE_CHROMIUM"
TIMEOUT_MS = 30_000


def chromium_path() -> str:
    """``$XLASERVE_CHROMIUM``, else ``chromium`` on PATH; fails the test when there is none."""
    path = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("the console's browser tests need Chromium: 'apt-get install -y chromium' (Debian; "
                    f".ci/run installs it), or set ${CHROMIUM_ENV} to a Chromium binary")
    return path


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    """(base URL, admin key, user key, the filled rows, screenshot dir) of a server over a filled ledger."""
    tmp = tmp_path_factory.mktemp("console")
    url = f"sqlite:///{tmp / 'ledger.db'}"
    db = open_database(url)
    store = KeyStore(db)
    admin, _ = store.create_key("ops", name="console admin", is_admin=True)
    user, _ = store.create_key("acme")
    ledger = Ledger(db)
    rows = fill_ledger(ledger, time.time())
    ledger.close()
    db.dispose()
    shots = tmp / "screenshots"
    shots.mkdir()
    print(f"console screenshots: {shots}")
    with serve_process([*TINY_SERVER_ARGS, "--skip-warmup", "--database-url", url], tmp / "server.log") as (_, base, log):
        yield {"url": base, "admin": admin, "user": user, "rows": rows, "shots": shots}
        log.seek(0)
        assert "Traceback" not in log.read()


@pytest.fixture(scope="module")
def page(console):
    """One browser tab, logged in through the login form with the admin key."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        tab.set_default_timeout(TIMEOUT_MS)
        r = tab.goto(console["url"] + "/console")
        assert r.status == 401 and tab.locator("#login").is_visible()
        tab.fill("#key", console["user"])  # not an admin's: refused, and the form says why
        tab.click("button[type=submit]")
        tab.wait_for_function("document.getElementById('message').textContent.includes('admin API key')")
        shot(tab, console, "login")
        tab.fill("#key", console["admin"])
        with tab.expect_navigation():
            tab.click("button[type=submit]")
        yield tab
        browser.close()


def shot(page, console, name: str) -> None:
    path = console["shots"] / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a drawn page, not a blank one


def test_overview_shows_the_ledgers_numbers(page, console):
    page.wait_for_selector("body[data-loaded]")
    expected = sums(console["rows"])
    shown = {m: float(page.get_attribute(f"#total-{m}", "data-value")) for m in expected}
    assert {m: v for m, v in shown.items() if m != "cost_usd"} == {
        m: v for m, v in expected.items() if m != "cost_usd"}
    assert shown["cost_usd"] == pytest.approx(expected["cost_usd"])
    assert page.inner_text("#total-requests") == str(expected["requests"])
    # The charts: one series per model, whose points sum to the ledger's per-model counts.
    drawn = page.eval_on_selector_all(
        "#chart-requests g.series",
        "gs => gs.map(g => [g.dataset.name, g.dataset.values.split(',').reduce((a, v) => a + Number(v || 0), 0)])")
    assert dict(drawn) == {m: sum(r["model"] == m for r in console["rows"]) for m in {r["model"] for r in console["rows"]}}
    assert page.locator("#chart-completion_tokens path").count() == 2
    assert page.locator("#chart-ttft g.series").count() == 3  # p50, p90, p99
    tenants = sorted({r["tenant"] for r in console["rows"]})
    page.select_option("#by", "tenant")
    page.wait_for_function("names => [...document.querySelectorAll('#chart-requests g.series')]"
                           ".every(g => names.includes(g.dataset.name))", arg=tenants)
    drawn = page.eval_on_selector_all("#chart-requests g.series", "gs => gs.map(g => g.dataset.name)")
    assert sorted(drawn) == tenants
    shot(page, console, "overview")


def test_a_requests_trace_opens_from_the_list(page, console):
    page.click("nav >> text=Requests")
    page.wait_for_selector("a.request-link")
    assert page.locator("#requests tbody tr").count() == len(console["rows"])
    page.fill("#q", "fill-0002")
    page.click("#search button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#requests tbody tr').length === 1")
    shot(page, console, "requests")
    page.click("a.request-link")
    page.wait_for_selector("body[data-loaded]")
    segments = page.eval_on_selector_all("#timeline g.segment", "gs => gs.map(g => g.dataset.name)")
    assert segments == ["queued", "prefill", "decode"]
    events = page.eval_on_selector_all("#timeline g.event", "gs => gs.map(g => g.dataset.name)")
    assert events == ["admitted", "engine_admitted", "first_token", "finished"]
    hops = page.eval_on_selector_all("#timeline g.hop", "gs => gs.map(g => [g.dataset.name, g.dataset.note])")
    assert hops == [["http://replica-9:9000", "overloaded"], ["http://replica-0:9000", "served"]]
    row = next(r for r in console["rows"] if r["request_id"] == "chatcmpl-fill0002")
    assert page.inner_text("#usage").count(str(row["prompt_tokens"])) >= 1
    assert "http://replica-0:9000" in page.inner_text("#routing")
    shot(page, console, "trace")


def test_a_key_created_and_revoked_in_the_console(page, console):
    page.click("nav >> text=Keys")
    page.wait_for_selector("body[data-loaded]")
    page.fill("#create-key input[name=tenant]", "browser")
    page.fill("#create-key input[name=rpm]", "30")
    page.click("#create-key button[type=submit]")
    page.wait_for_selector("#new-key:not([hidden])")
    key = page.inner_text("#new-key-text")
    key_id = page.get_attribute("#new-key-text", "data-key-id")
    models = httpx.get(console["url"] + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert models.status_code == 200
    page.wait_for_selector(f"#keys tr[data-key-id='{key_id}'] button.revoke")
    page.click(f"#keys tr[data-key-id='{key_id}'] button.revoke")
    page.wait_for_selector(f"#keys tr[data-key-id='{key_id}']:not(:has(button.revoke))")
    r = httpx.get(console["url"] + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_revoked"
    audit = page.inner_text("#audit")
    assert "key.create" in audit and "key.revoke" in audit and key_id in audit
    shot(page, console, "keys")


def test_the_playground_streams_a_reply_and_links_its_trace(page, console):
    with page.expect_navigation(wait_until="load"):  # its script has run (DOMContentLoaded) by then
        page.click("nav >> text=Playground")
    assert page.input_value("#api-key") == console["admin"]  # kept by the login form for /v1
    page.fill("#message", "Say something")
    page.fill("#max_tokens", "8")
    page.fill("#temperature", "0")
    page.click("#send")
    page.wait_for_selector("#usage[data-completion-tokens]")
    assert page.inner_text("#chat-error") == ""
    assert int(page.get_attribute("#usage", "data-completion-tokens")) == 8
    assert int(page.get_attribute("#reply", "data-chunks") or 0) >= 1
    assert page.inner_text("#finish") == "length"
    page.wait_for_selector("#trace-link:not([hidden])")
    shot(page, console, "playground")
    page.click("#trace-link")
    page.wait_for_selector("body[data-loaded]")
    assert "first_token" in page.inner_text("#events") and page.inner_text("[data-field=status] b") == "ok"
