"""LoRA adapters in the gateway over a fake engine: a request picks one by naming it as its
model, ``/v1/models`` lists each with its parent, the ledger meters it (at its own price, else
its base model's), and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` are admin-only, refuse bad folders and
in-use adapters with OpenAI-shaped errors."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from serving.contract.engine_client import LoraInUseError
from serving.gateway.app import ServedModel, create_app
from serving.gateway.openai.served_model import adapter_model
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import assert_openai_error

pytestmark = pytest.mark.anyio
BASE = "tiny-base"


@dataclasses.dataclass(eq=False)
class FakeLoraEngine(FakeEngine):
    """A FakeEngine that serves adapters by name (an adapter "busy" is in use; a path with
    "dora" in it is refused as the engine's reader refuses DoRA)."""

    adapters: set = dataclasses.field(default_factory=lambda: {"busy"})
    serves_lora: bool = True

    async def load_lora(self, name, path):
        if "dora" in path:
            raise ValueError(f"LoRA adapter {path}: DoRA adapters (use_dora) are not supported")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        self.adapters.add(name)

    async def unload_lora(self, name):
        if name == "busy":
            raise LoraInUseError(f"LoRA adapter {name!r} is in use by 1 request(s)")
        self.adapters.remove(name)


@pytest.fixture
def services(tmp_path):
    prices = tmp_path / "prices.yaml"
    prices.write_text("models:\n  busy: {input: 1000000.0, cached_input: 0.0, output: 0.0}\n"
                      f"  {BASE}: {{input: 2000000.0, cached_input: 0.0, output: 0.0}}\n")
    s = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", prices_path=str(prices))
    yield s
    s.close()


@pytest.fixture
def setup(services):
    engine = FakeLoraEngine(text="ok")
    base = ServedModel(BASE, engine, FakeTokenizer(), 512, created=1)
    app = create_app({BASE: base, "busy": adapter_model(base, "busy"), "plain": adapter_model(base, "plain")},
                     services, lora_root="/adapters")
    admin, _ = services.authenticator.key_store.create_key("ops", is_admin=True)
    user, _ = services.authenticator.key_store.create_key("acme")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    return engine, client, {"Authorization": f"Bearer {admin}"}, {"Authorization": f"Bearer {user}"}


async def test_models_list_adapters_with_parent_and_requests_name_them(setup, services):
    engine, client, admin, user = setup
    async with client:
        r = await client.get("/v1/models", headers=user)
        cards = {c["id"]: c for c in r.json()["data"]}
        assert cards[BASE]["parent"] is None and cards["busy"]["parent"] == BASE == cards["plain"]["parent"]
        r = await client.get("/v1/models/busy", headers=user)
        assert r.json()["parent"] == BASE
        for model in ("busy", BASE, "plain"):
            r = await client.post("/v1/completions", headers=user, json={"model": model, "prompt": "hi"})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
        assert [s.lora_name for s in engine.submitted] == ["busy", None, "plain"]
        r = await client.get("/v1/usage?group_by=model", headers=admin)
    rows = {row["group"]: row for row in r.json()["data"]}
    assert rows["busy"]["requests"] == 1 and rows[BASE]["requests"] == 1
    assert rows["busy"]["cost_usd"] == pytest.approx(rows["busy"]["prompt_tokens"])  # its own rate
    assert rows[BASE]["cost_usd"] == pytest.approx(2 * rows[BASE]["prompt_tokens"])
    assert rows["plain"]["cost_usd"] == pytest.approx(2 * rows["plain"]["prompt_tokens"])  # its base's rate


async def test_load_and_unload_at_run_time(setup):
    engine, client, admin, user = setup
    body = {"lora_name": "fresh", "lora_path": "/adapters/fresh"}
    async with client:
        assert_openai_error(await client.post("/v1/load_lora_adapter", headers=user, json=body), 403,
                            code="forbidden")
        r = await client.post("/v1/load_lora_adapter", headers=admin, json=body)
        assert r.status_code == 200 and r.json()["parent"] == BASE
        assert "fresh" in {c["id"] for c in (await client.get("/v1/models", headers=user)).json()["data"]}
        r = await client.post("/v1/completions", headers=user, json={"model": "fresh", "prompt": "hi"})
        assert r.status_code == 200 and engine.submitted[-1].lora_name == "fresh"
        assert_openai_error(await client.post("/v1/load_lora_adapter", headers=admin, json=body), 400,
                            code="lora_name_taken")
        err = assert_openai_error(await client.post("/v1/load_lora_adapter", headers=admin, json={
            "lora_name": "d", "lora_path": "/adapters/dora"}), 400, param="lora_path", code="invalid_lora_adapter")
        assert "DoRA" in err["message"]
        assert_openai_error(await client.post("/v1/load_lora_adapter", headers=admin, json={
            **body, "lora_name": "x", "base_model": "nope"}), 404, code="model_not_found")
        assert_openai_error(await client.post("/v1/load_lora_adapter", headers=admin, json={"lora_name": "x"}),
                            400)
        engine.serves_lora = False
        assert_openai_error(await client.post("/v1/load_lora_adapter", headers=admin, json={
            "lora_name": "y", "lora_path": "/adapters/p"}), 400, code="lora_not_supported")
        engine.serves_lora = True
        assert_openai_error(await client.post("/v1/unload_lora_adapter", headers=user,
                                              json={"lora_name": "fresh"}), 403)
        assert_openai_error(await client.post("/v1/unload_lora_adapter", headers=admin,
                                              json={"lora_name": "busy"}), 409, code="lora_in_use")
        assert_openai_error(await client.post("/v1/unload_lora_adapter", headers=admin,
                                              json={"lora_name": BASE}), 404, code="lora_not_found")
        r = await client.post("/v1/unload_lora_adapter", headers=admin, json={"lora_name": "fresh"})
        assert r.status_code == 200 and "fresh" not in engine.adapters
        assert_openai_error(await client.post("/v1/completions", headers=user,
                                              json={"model": "fresh", "prompt": "hi"}), 404, code="model_not_found")


async def test_adapter_paths_must_lie_under_the_lora_root(services, tmp_path):
    """An admin loads only folders under --lora-root (a relative path is taken under it); a path
    outside, a ``..`` escape or a symbolic link out of it gets the same 400 whether or not it exists
    (no file-existence oracle); without a root every run-time load is refused."""
    root = tmp_path / "adapters"
    (root / "good").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path)
    engine = FakeLoraEngine(text="ok")
    admin, _ = services.authenticator.key_store.create_key("ops", is_admin=True)
    headers = {"Authorization": f"Bearer {admin}"}
    models = {BASE: ServedModel(BASE, engine, FakeTokenizer(), 512, created=1)}
    loaded = []
    engine.load_lora = lambda name, path: _record(loaded, name, path)
    for lora_root in (None, root):
        app = create_app(models, services, lora_root=lora_root)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            async def load(name, path):
                return await client.post("/v1/load_lora_adapter", headers=headers,
                                         json={"lora_name": name, "lora_path": path})
            if lora_root is None:
                assert_openai_error(await load("a", str(root / "good")), 403, code="lora_loading_disabled")
                continue
            for path in ("/etc", "/nonexistent/x", str(root / ".." / "x"), str(root / "escape" / "x"),
                         "../x", str(root)):
                err = assert_openai_error(await load("a", path), 400, param="lora_path",
                                          code="lora_path_outside_root")
                assert path not in err["message"]
            assert (await load("a", str(root / "good"))).status_code == 200
            assert (await load("b", "good")).status_code == 200
    assert loaded == [("a", str(root / "good")), ("b", str(root / "good"))]


async def _record(loaded, name, path):
    loaded.append((name, path))


@dataclasses.dataclass(eq=False)
class FakeRoutedEngine(FakeLoraEngine):
    """A FakeLoraEngine standing for a router: it reports the adapters its replicas serve."""

    def routed_lora_names(self):
        return sorted(self.adapters)


async def test_models_follow_the_adapters_replicas_report(services):
    """Behind a router the gateway lists what the replicas serve now (loaded or unloaded on a
    replica, not through this gateway): added with their parent and base price, dropped (404)."""
    engine = FakeRoutedEngine(text="ok", adapters={"busy"})
    app = create_app({BASE: ServedModel(BASE, engine, FakeTokenizer(), 512, created=1)}, services)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    async with client:
        async def cards():
            return {c["id"]: c["parent"] for c in (await client.get("/v1/models")).json()["data"]}

        assert await cards() == {BASE: None, "busy": BASE}
        engine.adapters.add("late")  # loaded on the replicas by someone else
        r = await client.post("/v1/completions", json={"model": "late", "prompt": "hi"})
        assert r.status_code == 200 and engine.submitted[-1].lora_name == "late"
        assert (await client.get("/v1/models/late")).json()["parent"] == BASE
        engine.adapters.discard("late")
        assert await cards() == {BASE: None, "busy": BASE}
        assert_openai_error(await client.post("/v1/completions", json={"model": "late", "prompt": "hi"}), 404,
                            code="model_not_found")
    assert services.metering.prices.parents["late"] == BASE
