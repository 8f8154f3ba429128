"""Per-tenant prefix caching through the gateway, on the real engine loop (tiny-random model).

Two tenants, each with its own API key, send the same 1k-token prompt: the
engine shares cached prompt pages only within a tenant (``cache_scope.py``),
so the other tenant's first request gets ``cached_tokens: 0`` and each
tenant's second request gets its own cache.
"""

from __future__ import annotations

import httpx
import pytest

from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.tiny_engine import make_loop, prompt

pytestmark = pytest.mark.anyio
MODEL = "tiny-random"
PAGE = 64
PROMPT_TOKENS = 1000  # 15 full pages of 64 (960 tokens) and a partial one


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def loop(jax_cache):
    # Room for the prompt and its token; pages for both tenants' cached prompts and a request.
    loop = make_loop(max_model_len=1024 + PAGE, page_size=PAGE, num_pages=64, prefill_chunk=1024,
                     max_slots=2)
    loop.start(warmup=False)
    yield loop
    loop.stop()


async def test_tenants_do_not_share_prefix_cache_pages(loop, tiny_tokenizer, tmp_path):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    keys = {t: services.authenticator.key_store.create_key(t)[0] for t in ("tenant-a", "tenant-b")}
    app = create_app({MODEL: ServedModel(MODEL, loop, tiny_tokenizer, loop.max_model_len,
                                         kv_capacity_tokens=loop.kv_capacity_tokens)}, services)
    body = {"model": MODEL, "prompt": prompt(PROMPT_TOKENS), "max_tokens": 1, "temperature": 0}

    async def cached_tokens(tenant: str) -> int:
        r = await client.post("/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {keys[tenant]}"})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == PROMPT_TOKENS
        return usage["prompt_tokens_details"]["cached_tokens"]

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://testserver", timeout=60) as client:
            assert await cached_tokens("tenant-a") == 0
            assert await cached_tokens("tenant-b") == 0  # tenant a's pages are not tenant b's
            full_pages = PROMPT_TOKENS // PAGE * PAGE  # 960
            assert await cached_tokens("tenant-a") == full_pages
            assert await cached_tokens("tenant-b") == full_pages  # its own cache
    finally:
        services.close()
