"""A tenant's storage quotas for files and batches, checked inside the writing transaction.

Quotas (``api_keys.Quotas``, set per tenant with ``xlaserve tenants set --max-file-bytes
--max-files --max-batches``) bound what one tenant can make the gateway database hold:

* ``file_bytes``: the bytes of its files not yet expired (uploads and batch outputs);
* ``files``: how many such files;
* ``batches``: how many of its batches are unfinished.

An upload larger than ``file_bytes`` on its own is a 413; one that would take the tenant
past a quota, or a batch past ``batches``, is a 429 with code ``quota_exceeded``; both name
the quota in ``param`` and the message. The check reads the tenant's current use in the
transaction that then writes, so a tenant's sequential requests never overshoot (two
racing uploads on PostgreSQL's default isolation may together pass by one file). Batch
output files are written whatever the quota (the work is done and metered); they count
toward the next upload.

A write the database refuses because its storage is full (``database.is_disk_full``) is a
507 ``storage_full``, not the 503 of an unreachable database.
"""

from __future__ import annotations

from typing import Callable

import sqlalchemy as sa

from serving.gateway.accounts.api_keys import Quotas
from serving.gateway.accounts.database import batches as batches_table
from serving.gateway.accounts.database import files as files_table
from serving.gateway.http.errors import REQUEST_TOO_LARGE, OpenAIError

QuotaLookup = Callable[[str], Quotas]
"""Tenant name -> its quotas (``KeyStore.quotas``); blocking."""

UNFINISHED_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


def live_files(tenant: str, now: float):
    """The SQL condition for `tenant`'s files not expired at `now`."""
    return sa.and_(files_table.c.tenant == tenant,
                   sa.or_(files_table.c.expires_at.is_(None), files_table.c.expires_at > now))


def check_file_quota(conn: sa.Connection, quotas: Quotas, tenant: str, size: int, now: float) -> None:
    """Raises when storing one more file of `size` bytes would break `tenant`'s quotas.

    Raises:
      OpenAIError: 413 (``param`` ``file_bytes``) when the file alone is larger than the
        byte quota; 429 ``quota_exceeded`` naming ``files`` or ``file_bytes`` otherwise.
    """
    if quotas.file_bytes is not None and size > quotas.file_bytes:
        raise OpenAIError(f"The file ({size} bytes) is larger than tenant '{tenant}'s file_bytes quota "
                          f"({quotas.file_bytes} bytes).", status_code=413, param="file_bytes",
                          code=REQUEST_TOO_LARGE)
    if quotas.files is None and quotas.file_bytes is None:
        return
    count, used = conn.execute(sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(files_table.c.bytes), 0))
                               .where(live_files(tenant, now))).one()
    if quotas.files is not None and count >= quotas.files:
        raise quota_exceeded(tenant, "files", f"{count} files stored, quota {quotas.files} files")
    if quotas.file_bytes is not None and used + size > quotas.file_bytes:
        raise quota_exceeded(tenant, "file_bytes", f"{used} bytes stored + {size} bytes uploaded, "
                                                   f"quota {quotas.file_bytes} bytes")


def check_batch_quota(conn: sa.Connection, quotas: Quotas, tenant: str) -> None:
    """Raises a 429 ``quota_exceeded`` (``param`` ``batches``) when `tenant` already has
    its quota of unfinished batches."""
    if quotas.batches is None:
        return
    n = conn.execute(sa.select(sa.func.count()).select_from(batches_table).where(
        batches_table.c.tenant == tenant, batches_table.c.status.in_(UNFINISHED_BATCH_STATUSES))).scalar_one()
    if n >= quotas.batches:
        raise quota_exceeded(tenant, "batches", f"{n} unfinished batches, quota {quotas.batches}")


def quota_exceeded(tenant: str, quota: str, detail: str) -> OpenAIError:
    """429 ``quota_exceeded`` naming `quota` (``param``) and the numbers (`detail`)."""
    return OpenAIError(f"Tenant '{tenant}' has reached its {quota} quota ({detail}). Delete files, wait for "
                       "batches to finish, or ask the operator to raise it.", status_code=429, param=quota,
                       code="quota_exceeded")


def storage_full() -> OpenAIError:
    """507 ``storage_full``: the database's storage is full (the write was not made)."""
    return OpenAIError("The server's storage is full; the file was not stored. Try again later.",
                       status_code=507, code="storage_full", type="server_error")
