"""The audit trail of key and tenant changes: who created or revoked a key, or set a tenant's
limits, when, and with what settings (the ``audit`` table of ``database.py``).

:class:`serving.gateway.accounts.api_keys.KeyStore` writes an entry in the same transaction as the
change it records, so a change is never without its entry. The actor is the admin key's id when
the change came through the console, ``"cli"`` from ``xlaserve keys`` / ``xlaserve tenants``.
Secrets are never recorded (a created key's id and prefix only).
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

import sqlalchemy as sa

from serving.gateway.accounts.database import audit

CLI_ACTOR = "cli"
"""The actor of changes made with ``xlaserve keys`` and ``xlaserve tenants``."""

MAX_AUDIT_PAGE = 200
"""The most entries one :func:`audit_page` returns."""


def record_audit(conn: sa.Connection, actor: str, action: str, target: str,
                 details: Mapping[str, Any] | None = None) -> None:
    """Writes one audit entry on `conn` (inside the caller's transaction).

    Args:
      actor: who made the change (an admin key's id, or :data:`CLI_ACTOR`).
      action: ``key.create``, ``key.revoke`` or ``tenant.set``.
      target: the key id or tenant name changed.
      details: the settings applied (JSON-serializable; no secrets).
    """
    conn.execute(audit.insert().values(at=time.time(), actor=actor, action=action, target=target,
                                       details=None if details is None else json.dumps(details, sort_keys=True)))


def audit_page(engine: sa.Engine, limit: int = 50, before: int | None = None) -> tuple[list[dict], bool]:
    """The newest audit entries, newest first.

    Args:
      limit: entries wanted, 1 to :data:`MAX_AUDIT_PAGE`.
      before: only entries with an ``audit_id`` below this (the last id of the previous page).

    Returns:
      (entries as dicts with ``details`` parsed, whether older entries follow).

    Raises:
      ValueError: `limit` out of range.
    """
    if not 1 <= limit <= MAX_AUDIT_PAGE:
        raise ValueError(f"limit must be between 1 and {MAX_AUDIT_PAGE}; got {limit}")
    q = sa.select(audit).order_by(audit.c.audit_id.desc()).limit(limit + 1)
    if before is not None:
        q = q.where(audit.c.audit_id < before)
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(q).mappings()]
    for r in rows:
        r["details"] = json.loads(r["details"]) if r["details"] else None
    return rows[:limit], len(rows) > limit
