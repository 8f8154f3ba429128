"""API keys and tenants: create, list, revoke, and look up a bearer token.

A key is ``xls-`` followed by 43 URL-safe characters (256 random bits from
``secrets``), shown once at creation. Only its SHA-256 is stored: with that
much entropy a fast hash is enough (as for GitHub tokens or OpenAI keys), and
a lookup is one indexed query. Keys belong to a tenant; a tenant's optional
model allow-list and limits (``rpm``, ``tpm``, ``max_concurrent``) apply to all
its keys together, a key's own limits to that key alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import time
from typing import Sequence

import sqlalchemy as sa

from serving.gateway.accounts.database import api_keys, tenants

KEY_PREFIX = "xls-"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Rate limits of a key or a tenant; None means unlimited.

    Attributes:
      rpm: requests per minute.
      tpm: tokens per minute (prompt tokens + max_tokens reserved at admission,
        settled to prompt + completion tokens at the end).
      max_concurrent: requests in flight at once.
    """

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self):
        for name in ("rpm", "tpm", "max_concurrent"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 (or unset for no limit), got {v}")


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who is calling: the key's tenant, id and limits.

    Attributes:
      tenant: tenant name ("anonymous" when the server runs without keys).
      key_id: the key's public id (None when anonymous).
      is_admin: may read every tenant's usage and traces.
      models: the models the tenant may use (None: all).
      key_limits: limits of this key.
      tenant_limits: limits shared by all keys of the tenant.
    """

    tenant: str
    key_id: str | None
    is_admin: bool = False
    models: frozenset[str] | None = None
    key_limits: Limits = Limits()
    tenant_limits: Limits = Limits()

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal(tenant="anonymous", key_id=None, is_admin=True)
"""The caller when the server runs open (loopback, no keys configured)."""


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """A stored key, without its secret."""

    key_id: str
    tenant: str
    name: str | None
    key_prefix: str
    is_admin: bool
    limits: Limits
    created_at: float
    revoked_at: float | None


def hash_key(key: str) -> str:
    """Hex SHA-256 of a key's text."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyStore:
    """API keys and tenants in the gateway database (see ``database.py``).

    Args:
      engine: a SQLAlchemy engine from :func:`serving.gateway.accounts.database.open_database`.

    All methods block on the database; call them from a worker thread when on
    the event loop.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    # -- tenants ---------------------------------------------------------------

    def set_tenant(self, name: str, limits: Limits = Limits(),
                   models: Sequence[str] | None = None) -> None:
        """Creates or replaces tenant `name`'s limits and model allow-list."""
        if not name:
            raise ValueError("tenant name must not be empty")
        values = dict(rpm=limits.rpm, tpm=limits.tpm, max_concurrent=limits.max_concurrent,
                      models=None if models is None else json.dumps(sorted(models)))
        with self.engine.begin() as conn:
            updated = conn.execute(tenants.update().where(tenants.c.name == name).values(**values))
            if updated.rowcount == 0:
                conn.execute(tenants.insert().values(name=name, created_at=time.time(), **values))

    def tenant(self, name: str) -> tuple[Limits, frozenset[str] | None]:
        """(limits, model allow-list or None) of tenant `name`; unlimited if never set."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(tenants).where(tenants.c.name == name)).first()
        return _tenant_of(row)

    def list_tenants(self) -> list[dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(tenants).order_by(tenants.c.name)).mappings().all()
        return [dict(r) for r in rows]

    # -- keys ------------------------------------------------------------------

    def create_key(self, tenant: str, name: str | None = None, limits: Limits = Limits(),
                   is_admin: bool = False) -> tuple[str, KeyInfo]:
        """Creates a key for `tenant`. Returns (the key's text, shown only now; its info).

        Raises:
          ValueError: empty tenant name.
        """
        if not tenant:
            raise ValueError("tenant name must not be empty")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        info = KeyInfo(key_id="key_" + secrets.token_hex(6), tenant=tenant, name=name,
                       key_prefix=key[:10], is_admin=is_admin, limits=limits,
                       created_at=time.time(), revoked_at=None)
        with self.engine.begin() as conn:
            conn.execute(api_keys.insert().values(
                key_id=info.key_id, tenant=tenant, name=name, key_hash=hash_key(key),
                key_prefix=info.key_prefix, is_admin=is_admin, rpm=limits.rpm, tpm=limits.tpm,
                max_concurrent=limits.max_concurrent, created_at=info.created_at))
        return key, info

    def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        q = sa.select(api_keys).order_by(api_keys.c.created_at)
        if tenant is not None:
            q = q.where(api_keys.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [_key_info(r) for r in conn.execute(q).mappings()]

    def revoke(self, key_id: str) -> bool:
        """Revokes key `key_id`. Returns False if there is no such active key."""
        with self.engine.begin() as conn:
            res = conn.execute(api_keys.update()
                               .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at.is_(None))
                               .values(revoked_at=time.time()))
        return res.rowcount > 0

    def has_keys(self) -> bool:
        """True once any key was ever created (revoked ones count: revoking the
        last key must not open the server)."""
        with self.engine.connect() as conn:
            return conn.execute(sa.select(api_keys.c.key_id).limit(1)).first() is not None

    def lookup(self, key: str) -> tuple[str, Principal | None]:
        """Resolves a bearer token.

        Returns:
          ("ok", principal), ("revoked", None) or ("unknown", None).
        """
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(api_keys).where(api_keys.c.key_hash == hash_key(key))).mappings().first()
            if row is None:
                return "unknown", None
            if row["revoked_at"] is not None:
                return "revoked", None
            trow = conn.execute(sa.select(tenants).where(tenants.c.name == row["tenant"])).first()
        return "ok", _principal(row, trow)

    def principal(self, key_id: str) -> Principal | None:
        """The principal of key `key_id` now (a batch's owner at run time); None when
        the key is revoked or does not exist."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(api_keys).where(api_keys.c.key_id == key_id)).mappings().first()
            if row is None or row["revoked_at"] is not None:
                return None
            trow = conn.execute(sa.select(tenants).where(tenants.c.name == row["tenant"])).first()
        return _principal(row, trow)


def _principal(row, trow) -> Principal:
    tenant_limits, models = _tenant_of(trow)
    info = _key_info(row)
    return Principal(tenant=info.tenant, key_id=info.key_id, is_admin=info.is_admin,
                     models=models, key_limits=info.limits, tenant_limits=tenant_limits)


def _tenant_of(row) -> tuple[Limits, frozenset[str] | None]:
    if row is None:
        return Limits(), None
    r = row._mapping
    models = None if r["models"] is None else frozenset(json.loads(r["models"]))
    return Limits(r["rpm"], r["tpm"], r["max_concurrent"]), models


def _key_info(r) -> KeyInfo:
    return KeyInfo(key_id=r["key_id"], tenant=r["tenant"], name=r["name"], key_prefix=r["key_prefix"],
                   is_admin=bool(r["is_admin"]), limits=Limits(r["rpm"], r["tpm"], r["max_concurrent"]),
                   created_at=r["created_at"], revoked_at=r["revoked_at"])
