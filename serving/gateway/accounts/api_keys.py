"""API keys and tenants: create, list, revoke, and look up a bearer token.

A key is ``xls-`` followed by 43 URL-safe characters (256 random bits from
``secrets``), shown once at creation. Only its SHA-256 is stored: with that
much entropy a fast hash is enough (as for GitHub tokens or OpenAI keys), and
a lookup is one indexed query. Keys belong to a tenant; a tenant's optional
model allow-list and limits (``rpm``, ``tpm``, ``max_concurrent``) apply to all
its keys together, a key's own limits to that key alone. A tenant and a key may
each carry a service-tier allow-list (``service_tiers``: "default", "flex",
"priority"; None: all); a request may ask for a tier both allow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import time
from typing import Sequence

import sqlalchemy as sa

from serving.gateway.accounts.database import api_keys, cursor_page, tenants
from serving.gateway.accounts.key_audit import CLI_ACTOR, record_audit

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
class Quotas:
    """A tenant's storage quotas (files and batches); None means unlimited.

    Attributes:
      file_bytes: bytes of all its stored files together (uploads and batch outputs).
      files: how many files it may store at once.
      batches: how many of its batches may be unfinished (validating, in progress,
        finalizing, cancelling) at once.
    """

    file_bytes: int | None = None
    files: int | None = None
    batches: int | None = None

    def __post_init__(self):
        for name in ("file_bytes", "files", "batches"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} quota must be >= 1 (or unset for no quota), got {v}")


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
      service_tiers: the service tiers it may ask for (the key's and the tenant's
        allow-lists together; None: all).
    """

    tenant: str
    key_id: str | None
    is_admin: bool = False
    models: frozenset[str] | None = None
    key_limits: Limits = Limits()
    tenant_limits: Limits = Limits()
    service_tiers: frozenset[str] | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal(tenant="anonymous", key_id=None, is_admin=False)
"""The caller when the server runs open (loopback, no keys configured). Never an admin: an open
server loads no LoRA adapters and shows no other tenant's usage or traces (admin keys do)."""


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
    service_tiers: frozenset[str] | None = None


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
        self.generation = 0
        """Counts this process's changes of what a key resolves to (a revoke, a tenant's
        limits); an :class:`~serving.gateway.accounts.auth.Authenticator` drops its cached
        look-ups when it moves."""

    # -- tenants ---------------------------------------------------------------

    def set_tenant(self, name: str, limits: Limits = Limits(),
                   models: Sequence[str] | None = None, service_tiers: Sequence[str] | None = None,
                   actor: str = CLI_ACTOR, quotas: Quotas | None = None) -> None:
        """Creates or replaces tenant `name`'s limits, model and service-tier allow-lists
        and (unless `quotas` is None: kept as they are) storage quotas, recorded in the
        audit trail as `actor`'s (``key_audit.py``).

        Raises:
          ValueError: an empty name, or a tier that is not default, flex or priority.
        """
        if not name:
            raise ValueError("tenant name must not be empty")
        values = dict(rpm=limits.rpm, tpm=limits.tpm, max_concurrent=limits.max_concurrent,
                      models=None if models is None else json.dumps(sorted(models)),
                      service_tiers=_tiers_json(service_tiers))
        if quotas is not None:
            values.update(max_file_bytes=quotas.file_bytes, max_files=quotas.files, max_batches=quotas.batches)
        with self.engine.begin() as conn:
            updated = conn.execute(tenants.update().where(tenants.c.name == name).values(**values))
            if updated.rowcount == 0:
                conn.execute(tenants.insert().values(name=name, created_at=time.time(), **values))
            record_audit(conn, actor, "tenant.set", name, {
                "rpm": limits.rpm, "tpm": limits.tpm, "max_concurrent": limits.max_concurrent,
                "models": None if models is None else sorted(models),
                "service_tiers": None if service_tiers is None else sorted(set(service_tiers)),
                **({} if quotas is None else {"quotas": dataclasses.asdict(quotas)})})
        self.generation += 1

    def quotas(self, name: str) -> Quotas:
        """Tenant `name`'s storage quotas (unlimited if never set)."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(tenants.c.max_file_bytes, tenants.c.max_files, tenants.c.max_batches)
                               .where(tenants.c.name == name)).first()
        return Quotas() if row is None else Quotas(*row)

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
                   is_admin: bool = False, service_tiers: Sequence[str] | None = None,
                   actor: str = CLI_ACTOR) -> tuple[str, KeyInfo]:
        """Creates a key for `tenant`. Returns (the key's text, shown only now; its info).

        Args:
          service_tiers: the tiers this key may ask for (None: all the tenant allows).
          actor: who creates it, for the audit trail (an admin key's id, or "cli").

        Raises:
          ValueError: empty tenant name, or a tier that is not default, flex or priority.
        """
        if not tenant:
            raise ValueError("tenant name must not be empty")
        tiers_json = _tiers_json(service_tiers)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        info = KeyInfo(key_id="key_" + secrets.token_hex(6), tenant=tenant, name=name,
                       key_prefix=key[:10], is_admin=is_admin, limits=limits,
                       created_at=time.time(), revoked_at=None,
                       service_tiers=None if service_tiers is None else frozenset(service_tiers))
        with self.engine.begin() as conn:
            conn.execute(api_keys.insert().values(
                key_id=info.key_id, tenant=tenant, name=name, key_hash=hash_key(key),
                key_prefix=info.key_prefix, is_admin=is_admin, rpm=limits.rpm, tpm=limits.tpm,
                max_concurrent=limits.max_concurrent, created_at=info.created_at,
                service_tiers=tiers_json))
            record_audit(conn, actor, "key.create", info.key_id, {
                "tenant": tenant, "name": name, "key_prefix": info.key_prefix, "is_admin": is_admin,
                "rpm": limits.rpm, "tpm": limits.tpm, "max_concurrent": limits.max_concurrent,
                "service_tiers": None if service_tiers is None else sorted(set(service_tiers))})
        return key, info

    def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        q = sa.select(api_keys).order_by(api_keys.c.created_at)
        if tenant is not None:
            q = q.where(api_keys.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [_key_info(r) for r in conn.execute(q).mappings()]

    def list_keys_page(self, tenant: str | None = None, limit: int = 50,
                       after: str | None = None) -> tuple[list[KeyInfo], bool]:
        """One page of keys (of `tenant`), newest first.

        Args:
          limit: keys wanted (the caller bounds it).
          after: the last key id of the previous page (None: the first page).

        Returns:
          (keys, whether more follow).
        """
        where = sa.true() if tenant is None else api_keys.c.tenant == tenant
        with self.engine.connect() as conn:
            rows, more = cursor_page(conn, api_keys, "key_id", where, limit, after)
        return [_key_info(r) for r in rows], more

    def revoke(self, key_id: str, actor: str = CLI_ACTOR) -> bool:
        """Revokes key `key_id`, recorded in the audit trail as `actor`'s. Returns False if there
        is no such active key (nothing recorded then)."""
        with self.engine.begin() as conn:
            res = conn.execute(api_keys.update()
                               .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at.is_(None))
                               .values(revoked_at=time.time()))
            if res.rowcount > 0:
                record_audit(conn, actor, "key.revoke", key_id)
        self.generation += 1
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
    tiers = info.service_tiers
    tenant_tiers = None if trow is None else _tiers_of(trow._mapping["service_tiers"])
    if tenant_tiers is not None:
        tiers = tenant_tiers if tiers is None else tiers & tenant_tiers
    return Principal(tenant=info.tenant, key_id=info.key_id, is_admin=info.is_admin,
                     models=models, key_limits=info.limits, tenant_limits=tenant_limits,
                     service_tiers=tiers)


_TIERS = ("default", "flex", "priority")  # serving.gateway.services.service_tiers.SERVED_TIERS


def _tiers_json(tiers: Sequence[str] | None) -> str | None:
    """A service-tier allow-list as stored (JSON list; None: all).

    Raises:
      ValueError: a tier that is not default, flex or priority.
    """
    if tiers is None:
        return None
    bad = sorted(set(tiers) - set(_TIERS))
    if bad:
        raise ValueError(f"service tiers must be among {', '.join(_TIERS)}; got {', '.join(bad)}")
    return json.dumps(sorted(set(tiers)))


def _tiers_of(value: str | None) -> frozenset[str] | None:
    return None if value is None else frozenset(json.loads(value))


def _tenant_of(row) -> tuple[Limits, frozenset[str] | None]:
    if row is None:
        return Limits(), None
    r = row._mapping
    models = None if r["models"] is None else frozenset(json.loads(r["models"]))
    return Limits(r["rpm"], r["tpm"], r["max_concurrent"]), models


def _key_info(r) -> KeyInfo:
    return KeyInfo(key_id=r["key_id"], tenant=r["tenant"], name=r["name"], key_prefix=r["key_prefix"],
                   is_admin=bool(r["is_admin"]), limits=Limits(r["rpm"], r["tpm"], r["max_concurrent"]),
                   created_at=r["created_at"], revoked_at=r["revoked_at"],
                   service_tiers=_tiers_of(r["service_tiers"]))
