"""OpenAI's Files API for batch input and output: ``/v1/files``.

Routes (all scoped to the caller's tenant: another tenant's file is a 404):

* ``POST /v1/files``: a ``multipart/form-data`` upload with a ``file`` part and
  ``purpose=batch``, optionally ``expires_after[anchor]=created_at`` and
  ``expires_after[seconds]`` (3600..2592000, OpenAI's); answers the file object. The body is
  held to the server's ``max_file_bytes`` (413 in OpenAI's shape, counted while the upload
  streams in, never after reading it all), not to ``max_request_bytes``, and to the tenant's
  storage quotas (``storage_quotas.py``: 413/429 naming the quota; a tenant's uploads sent
  within a second of its last 429 are answered from it, at that second's end); a database
  whose storage is full answers 507 ``storage_full``.
* ``GET /v1/files`` (``purpose``, ``limit`` 1..10000, ``after``, ``order``
  asc|desc by creation), ``GET /v1/files/{file_id}``,
  ``GET /v1/files/{file_id}/content`` (the bytes as uploaded or written),
  ``DELETE /v1/files/{file_id}``.

Contents are stored in the gateway database (``database.files``), so every
gateway sharing it serves the same files. A file past its ``expires_at`` is gone at once
for every route (404) and deleted by the batch runner's sweep (:meth:`FileStore.sweep_expired`). A batch's output and error files
are files of purpose ``batch_output``, written by the batch runner. The lines
of a ``batch`` file are checked when a batch is created from it
(``batches.py``), as OpenAI does; the upload only checks its size and purpose.
"""

from __future__ import annotations

import time
import uuid
from email.message import Message
from typing import Any, Callable, Literal

import anyio
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Query, Request
from pydantic import BaseModel
from starlette.datastructures import UploadFile
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.accounts.database import cursor_page, is_disk_full
from serving.gateway.accounts.database import files as files_table
from serving.gateway.batch.storage_quotas import QuotaLookup, check_file_quota, live_files, storage_full
from serving.gateway.http.errors import REQUEST_TOO_LARGE, OpenAIError
from serving.gateway.http.openapi import error_responses

FILES_PATH = "/v1/files"
UPLOAD_PURPOSES = ("batch",)
"""Purposes a client may upload; ``batch_output`` files are written by batches only."""
FORM_OVERHEAD_BYTES = 64 * 1024
"""Room for the multipart framing and the ``purpose`` field on top of ``max_file_bytes``."""
MAX_LIST_LIMIT = 10_000
QUOTA_REFUSAL_S = 1.0
"""Seconds a tenant's upload refused for its quota (429) answers its next ones without a query
(held to the second's end: see ``_answer_remembered_refusal``)."""
MAX_HELD_UPLOADS = 16
"""A tenant's uploads held to the end of a refusal at once; past it they are answered at once."""
EXPIRES_AFTER_RANGE_S = (3600, 2_592_000)
"""OpenAI's bounds on ``expires_after.seconds`` (one hour to 30 days)."""


class FileObject(BaseModel):
    """OpenAI's file object (times in Unix seconds)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def list_page(data: list[dict], has_more: bool) -> dict:
    """OpenAI's cursor-paged list body: ``data``, ``has_more``, ``first_id``, ``last_id``."""
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def file_not_found(file_id: str, param: str = "file_id") -> OpenAIError:
    """404 for a file that does not exist or belongs to another tenant."""
    return OpenAIError(f"No such File object: {file_id}", status_code=404, param=param,
                       code="file_not_found")


def file_object(row: dict) -> dict:
    """The API's JSON for a ``files`` row."""
    expires = row.get("expires_at")
    return FileObject(id=row["file_id"], bytes=row["bytes"], created_at=int(row["created_at"]),
                      filename=row["filename"], purpose=row["purpose"],
                      expires_at=None if expires is None else int(expires)).model_dump(mode="json")


def expires_after_seconds(anchor: object, seconds: object, param: str = "expires_after") -> float | None:
    """The seconds of an ``expires_after`` (``{"anchor": "created_at", "seconds": N}``, OpenAI's),
    None when neither part is given.

    Raises:
      OpenAIError: 400 naming `param` for another anchor, a missing part, or seconds outside
        3600..2592000.
    """
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise OpenAIError(f"'{param}.anchor' must be 'created_at'; got {anchor!r}.", param=param)
    try:
        n = int(str(seconds))
    except ValueError:
        n = None
    lo, hi = EXPIRES_AFTER_RANGE_S
    if n is None or not lo <= n <= hi:
        raise OpenAIError(f"'{param}.seconds' must be an integer in [{lo}, {hi}]; got {seconds!r}.", param=param)
    return float(n)


class FileStore:
    """Files in the gateway database. Every method blocks on it (call from a worker thread).

    Args:
      engine: a SQLAlchemy engine (tables created; see ``database.py``).
      clock: Unix seconds now (injectable for tests).
    """

    def __init__(self, engine: sa.Engine, clock: Callable[[], float] = time.time,
                 quotas: QuotaLookup | None = None) -> None:
        self.engine = engine
        self.clock = clock
        self.quotas = quotas
        # tenant -> (until, on the monotonic clock; the smallest size refused; the 429's fields):
        # check_quota's recent refusals (see there)
        self._refused: dict[str, tuple[float, int, dict]] = {}
        self.held_uploads: dict[str, int] = {}
        """tenant -> its uploads held to the end of a refusal now (the upload route's)"""

    def create(self, tenant: str, purpose: str, filename: str, content: bytes,
               conn: sa.Connection | None = None, expires_after_s: float | None = None,
               check_quota: bool = False) -> dict:
        """Stores a file; returns its row (without the content).

        Args:
          conn: a connection whose transaction the insert joins (None: its own).
          expires_after_s: seconds after creation it expires (None: kept until deleted).
          check_quota: hold it to the tenant's quotas (uploads; batch outputs are not).

        Raises:
          OpenAIError: 413/429 for a quota (``storage_quotas.check_file_quota``); 507
            ``storage_full`` when the database's storage is full.
        """
        now = self.clock()
        row = dict(file_id="file-" + uuid.uuid4().hex, tenant=tenant, purpose=purpose,
                   filename=filename, bytes=len(content), created_at=now,
                   expires_at=None if expires_after_s is None else now + expires_after_s)
        stmt = files_table.insert().values(content=content, **row)

        def write(c: sa.Connection) -> None:
            if check_quota and self.quotas is not None:
                check_file_quota(c, self.quotas(tenant), tenant, len(content), now)
            c.execute(stmt)

        try:
            if conn is not None:
                write(conn)
            else:
                with self.engine.begin() as c:
                    write(c)
        except sa.exc.DBAPIError as e:
            if is_disk_full(e):
                raise storage_full() from e
            raise
        return row

    def check_quota(self, tenant: str, at_least: int) -> None:
        """Before reading an upload: raises what :meth:`create` would for a file of at least
        `at_least` bytes (the body's length less the form's framing), so a tenant over its
        quota is answered without its body being read and parsed.

        A 429 is remembered for ``QUOTA_REFUSAL_S`` (the ``Retry-After`` it sends): the tenant's
        uploads of at least that size in that second get the same answer without a database
        query, so a tenant sending uploads over its quota as fast as it can costs the database
        one query a second, not one per request (beside it, every tenant's metering writes wait
        for the same connections). Deleting one of its files forgets the refusal at once; a
        file another gateway deleted, or a raised quota, counts within the second.

        Raises:
          OpenAIError: 413/429 for a quota (``storage_quotas.check_file_quota``).
        """
        if self.quotas is None:
            return
        self.check_remembered_refusal(tenant, at_least)
        quotas = self.quotas(tenant)
        try:
            with self.engine.connect() as conn:
                check_file_quota(conn, quotas, tenant, at_least, self.clock())
        except OpenAIError as e:
            if e.status_code == 429:
                if len(self._refused) > 4096:  # forget the tenants whose refusals ran out
                    now = time.monotonic()
                    self._refused = {t: r for t, r in self._refused.items() if r[0] > now}
                retry = {"Retry-After": str(max(1, round(QUOTA_REFUSAL_S)))}
                self._refused[tenant] = (time.monotonic() + QUOTA_REFUSAL_S, at_least, quotas.file_bytes, dict(
                    message=e.message, status_code=e.status_code, type=e.type, param=e.param, code=e.code,
                    headers=retry))
                e.headers.update(retry)
            raise

    def remembered_refusal(self, tenant: str, at_least: int) -> tuple[float, OpenAIError] | None:
        """The 429 of `tenant`'s upload refused within ``QUOTA_REFUSAL_S`` if this one (of at
        least `at_least` bytes) is at least as large, with the seconds left until that refusal
        runs out; else None. No database query: callable on the event loop."""
        refused = self._refused.get(tenant)
        if refused is None:
            return None
        until, size, byte_quota, fields = refused
        left = until - time.monotonic()
        # at least as large as the refused upload, and not alone over the byte quota (a 413)
        if left > 0 and size <= at_least and (byte_quota is None or at_least <= byte_quota):
            return left, OpenAIError(**fields)
        return None

    def check_remembered_refusal(self, tenant: str, at_least: int) -> None:
        """Raises :meth:`remembered_refusal`'s 429, if there is one.

        Raises:
          OpenAIError: 429 ``quota_exceeded`` (the remembered refusal, with its ``Retry-After``).
        """
        refusal = self.remembered_refusal(tenant, at_least)
        if refusal is not None:
            raise refusal[1]

    def get(self, file_id: str, tenant: str) -> dict | None:
        """The row of `tenant`'s file `file_id` (without the content), or None (also once expired)."""
        cols = [c for c in files_table.c if c.name != "content"]
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(*cols).where(files_table.c.file_id == file_id,
                                                      live_files(tenant, self.clock()))).mappings().first()
        return None if row is None else dict(row)

    def content(self, file_id: str, tenant: str) -> bytes | None:
        """The bytes of `tenant`'s file `file_id`, or None (also once expired)."""
        with self.engine.connect() as conn:
            return conn.execute(sa.select(files_table.c.content).where(
                files_table.c.file_id == file_id, live_files(tenant, self.clock()))).scalar()

    def sweep_expired(self) -> int:
        """Deletes every tenant's expired files; returns how many."""
        with self.engine.begin() as conn:
            return conn.execute(files_table.delete().where(files_table.c.expires_at <= self.clock())).rowcount

    def list(self, tenant: str, purpose: str | None = None, limit: int = MAX_LIST_LIMIT,
             after: str | None = None, descending: bool = True) -> tuple[list[dict], bool]:
        """(rows, has_more) of `tenant`'s files not expired, newest first unless not `descending`."""
        where = live_files(tenant, self.clock())
        if purpose is not None:
            where = sa.and_(where, files_table.c.purpose == purpose)
        with self.engine.connect() as conn:
            return cursor_page(conn, files_table, "file_id", where, limit, after, descending)

    def delete(self, file_id: str, tenant: str) -> bool:
        """Deletes `tenant`'s file `file_id`. Returns False if there was none."""
        self._refused.pop(tenant, None)  # room, perhaps: its next upload asks the database
        with self.engine.begin() as conn:
            res = conn.execute(files_table.delete().where(files_table.c.file_id == file_id,
                                                          files_table.c.tenant == tenant))
        return res.rowcount > 0


def upload_body_limit(max_file_bytes: int | None) -> int | None:
    """The most bytes a ``POST /v1/files`` body may have: the file plus the form's framing."""
    return None if max_file_bytes is None else max_file_bytes + FORM_OVERHEAD_BYTES


def file_too_large(max_file_bytes: int, size: int) -> OpenAIError:
    return OpenAIError(f"The file ({size} bytes) is larger than this server accepts: at most "
                       f"{max_file_bytes} bytes (the server's max_file_bytes).", status_code=413,
                       param="file", code=REQUEST_TOO_LARGE)


_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)}}}}}}}


def _require_multipart(content_type: str | None) -> None:
    header = Message()
    header["content-type"] = content_type or ""
    if header.get_content_type() != "multipart/form-data":
        raise OpenAIError(f"Content-Type must be 'multipart/form-data'; got "
                          f"{repr(content_type) if content_type else 'none'}.", status_code=415,
                          code="unsupported_media_type")


async def _answer_remembered_refusal(files: FileStore, tenant: str, at_least: int) -> None:
    """A tenant's upload sent while its last refusal (429, ``Retry-After``) still holds, on the
    event loop: no worker thread, no query; answered with that 429 once the refusal runs out
    (at most ``QUOTA_REFUSAL_S``), unless more than ``MAX_HELD_UPLOADS`` of the tenant's are
    held already (then at once). A client that honours Retry-After is never held; one that
    sends again at once (an attacker's loop) gets about one answer a second a connection,
    instead of hundreds of 429s whose bodies the server reads to their end after each (the
    client sends all of it before it reads the answer; closing the connection instead makes
    its client see a reset, not the 429).

    Raises:
      OpenAIError: the remembered 429 ``quota_exceeded``.
    """
    refusal = files.remembered_refusal(tenant, at_least)
    if refusal is None:
        return
    left, error = refusal
    held = files.held_uploads
    if held.get(tenant, 0) < MAX_HELD_UPLOADS:
        held[tenant] = held.get(tenant, 0) + 1
        try:
            await anyio.sleep(left)
        finally:
            held[tenant] -= 1
            if not held[tenant]:
                del held[tenant]
    raise error


def install_file_routes(app: FastAPI, store: Callable[[], FileStore], principal: Callable,
                        max_file_bytes: int | None) -> None:
    """Adds the ``/v1/files`` routes to `app`.

    Args:
      store: returns the file store (raising OpenAIError 404 ``no_ledger`` when
        the server keeps no database).
      principal: the FastAPI dependency that authenticates the caller.
      max_file_bytes: the largest file in bytes (None: unlimited).
    """

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args))

    @app.post(FILES_PATH, response_model=FileObject, openapi_extra=_UPLOAD_BODY,
              responses=error_responses(400, 401, 403, 404, 413, 415, 429, 507))
    async def upload_file(request: Request, caller: Principal = Depends(principal)) -> Response:
        files = store()
        _require_multipart(request.headers.get("content-type"))
        length = request.headers.get("content-length", "")
        if length.isdigit():  # over a quota already: answered before the body is read
            at_least = max(int(length) - FORM_OVERHEAD_BYTES, 0)
            await _answer_remembered_refusal(files, caller.tenant, at_least)
            await run(files.check_quota, caller.tenant, at_least)
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str) or purpose not in UPLOAD_PURPOSES:
                raise OpenAIError(f"'purpose' must be one of {', '.join(UPLOAD_PURPOSES)}; got "
                                  f"{purpose!r}.", param="purpose")
            if not isinstance(upload, UploadFile):
                raise OpenAIError("Missing required parameter: 'file' (a file part of the form).",
                                  param="file")
            if max_file_bytes is not None and (upload.size or 0) > max_file_bytes:
                raise file_too_large(max_file_bytes, upload.size)
            expires_s = expires_after_seconds(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
            content = await upload.read()
            filename = (upload.filename or "upload.jsonl")[:512]
        row = await anyio.to_thread.run_sync(lambda: files.create(
            caller.tenant, purpose, filename, content, expires_after_s=expires_s, check_quota=True))
        return JSONResponse(file_object(row))

    @app.get(FILES_PATH, response_model=FileList, responses=error_responses(400, 401, 403, 404, 413))
    async def list_files(purpose: str | None = None,
                         limit: int = Query(MAX_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
                         after: str | None = None, order: Literal["asc", "desc"] = "desc",
                         caller: Principal = Depends(principal)) -> Response:
        rows, has_more = await run(store().list, caller.tenant, purpose, limit, after, order == "desc")
        return JSONResponse(list_page([file_object(r) for r in rows], has_more))

    @app.get(FILES_PATH + "/{file_id}", response_model=FileObject,
             responses=error_responses(401, 403, 404, 413))
    async def retrieve_file(file_id: str, caller: Principal = Depends(principal)) -> Response:
        row = await run(store().get, file_id, caller.tenant)
        if row is None:
            raise file_not_found(file_id)
        return JSONResponse(file_object(row))

    @app.get(FILES_PATH + "/{file_id}/content", response_class=Response, responses={
        200: {"description": "The file's bytes.",
              "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        **error_responses(401, 403, 404, 413)})
    async def file_content(file_id: str, caller: Principal = Depends(principal)) -> Response:
        content = await run(store().content, file_id, caller.tenant)
        if content is None:
            raise file_not_found(file_id)
        return Response(bytes(content), media_type="application/octet-stream")

    @app.delete(FILES_PATH + "/{file_id}", response_model=FileDeleted,
                responses=error_responses(401, 403, 404, 413))
    async def delete_file(file_id: str, caller: Principal = Depends(principal)) -> Response:
        if not await run(store().delete, file_id, caller.tenant):
            raise file_not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
