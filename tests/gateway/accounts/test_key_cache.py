"""The key look-up's one-second memory (issue 44: the hostile tenant's hundreds of requests a
second each cost a database query in a worker thread before it was refused).

A key found active answers for ``KEY_CACHE_S`` without a query; a revocation or a tenant's
new limits made through the same process's key store apply at once, one made by another
process (another ``KeyStore`` on the same database) within ``KEY_CACHE_S``; revoked and
unknown keys are never remembered.
"""

from __future__ import annotations

import time

import pytest

from serving.gateway.accounts import auth
from serving.gateway.accounts.api_keys import KeyStore, Limits
from serving.gateway.accounts.auth import Authenticator
from serving.gateway.accounts.database import open_database
from serving.gateway.http.errors import OpenAIError

pytestmark = pytest.mark.anyio


class CountingKeyStore(KeyStore):
    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.lookups = 0

    def lookup(self, key: str):
        self.lookups += 1
        return super().lookup(key)


@pytest.fixture
def stores(tmp_path):
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    return CountingKeyStore(open_database(url)), KeyStore(open_database(url))


async def _code(authenticator: Authenticator, key: str) -> str:
    try:
        await authenticator.authenticate(f"Bearer {key}")
    except OpenAIError as e:
        return e.code
    return "ok"


async def test_an_active_key_is_looked_up_once_a_second(stores):
    store, _ = stores
    key, info = store.create_key("acme")
    authenticator = Authenticator(store)
    principals = [await authenticator.authenticate(f"Bearer {key}") for _ in range(50)]
    assert store.lookups == 1
    assert {p.key_id for p in principals} == {info.key_id} and {p.tenant for p in principals} == {"acme"}


async def test_a_revocation_in_this_process_applies_at_once(stores):
    store, _ = stores
    key, info = store.create_key("acme")
    authenticator = Authenticator(store)
    assert await _code(authenticator, key) == "ok"
    assert store.revoke(info.key_id)
    assert await _code(authenticator, key) == "api_key_revoked"
    assert await _code(authenticator, key) == "api_key_revoked"
    assert store.lookups == 3  # a revoked key is never remembered


async def test_new_tenant_limits_in_this_process_apply_at_once(stores):
    store, _ = stores
    key, _ = store.create_key("acme")
    authenticator = Authenticator(store)
    assert (await authenticator.authenticate(f"Bearer {key}")).tenant_limits == Limits()
    store.set_tenant("acme", Limits(rpm=7))
    assert (await authenticator.authenticate(f"Bearer {key}")).tenant_limits == Limits(rpm=7)


async def test_another_processs_revocation_applies_within_the_cache_time(stores, monkeypatch):
    store, other = stores
    monkeypatch.setattr(auth, "KEY_CACHE_S", 0.2)
    key, info = store.create_key("acme")
    authenticator = Authenticator(store)
    assert await _code(authenticator, key) == "ok"
    assert other.revoke(info.key_id)  # another gateway, or `xlaserve keys revoke`
    assert await _code(authenticator, key) == "ok"  # remembered
    time.sleep(0.25)
    assert await _code(authenticator, key) == "api_key_revoked"
    assert store.lookups == 2


async def test_unknown_keys_are_never_remembered(stores):
    store, _ = stores
    store.create_key("acme")
    authenticator = Authenticator(store)
    late = "xls-" + "a" * 43
    assert await _code(authenticator, late) == "invalid_api_key"
    assert await _code(authenticator, late) == "invalid_api_key"
    assert store.lookups == 2
