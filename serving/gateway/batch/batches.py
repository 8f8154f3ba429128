"""OpenAI's Batch API: ``/v1/batches``, the batch state machine and its storage.

Routes (scoped to the caller's tenant: another tenant's batch is a 404):

* ``POST /v1/batches`` ``{"input_file_id", "endpoint", "completion_window": "24h",
  "metadata"?}``: a batch over a ``batch`` file's lines for ``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/responses``, ``/v1/embeddings``, ``/v1/rerank`` or ``/v1/score``; answers the
  batch object in status ``validating``.
* ``GET /v1/batches`` (``limit`` 1..100, ``after``), ``GET /v1/batches/{batch_id}``,
  ``POST /v1/batches/{batch_id}/cancel``.

Statuses, each with its ``<status>_at`` timestamp (Unix seconds)::

    validating -> in_progress -> finalizing -> completed
        |              |   \\-> expired       (expires_at = created_at + 24 h passed)
        v              v
      failed       cancelling -> cancelled   (POST .../cancel, from any unfinished status)

``validating`` checks every line of the input file (a JSON object with a unique
``custom_id``, ``"method": "POST"``, the batch's ``url`` and a JSON object
``body``; at most :data:`MAX_LINES` lines); one bad line fails the batch with
``errors``. A line whose *body* is invalid for the endpoint still runs and
gives an error line, as at OpenAI. ``request_counts`` are ``total``,
``completed`` (2xx answers) and ``failed`` (other answers, and lines expired
unrun). Output and error files (purpose ``batch_output``) hold one JSON line
per ``custom_id``, in input order: ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``.

State lives in the gateway database (``batches``, ``batch_lines``), so any
gateway sharing it may run a batch; the runner (``batch_runner.py``) takes a
lease on a batch before touching it, and every write here that changes a
batch's state is conditional on that lease.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Literal, Mapping

import anyio
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.accounts.database import batch_lines, batches, cursor_page, database_clock, database_time
from serving.gateway.accounts.database import requests as requests_table
from serving.gateway.batch.files import EXPIRES_AFTER_RANGE_S, FileStore, file_not_found, list_page
from serving.gateway.batch.storage_quotas import check_batch_quota
from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.openapi import error_responses, json_request_body
from serving.gateway.openai.openai_serving import read_json

BATCHES_PATH = "/v1/batches"
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/rerank",
                   "/v1/score")
"""Endpoints a batch may name; only those with a registered handler are accepted."""
COMPLETION_WINDOW_S = {"24h": 24 * 3600.0}
MAX_LINES = 50_000
"""OpenAI's limit of requests per batch."""
MAX_REPORTED_ERRORS = 100
"""Validation errors kept on a failed batch (the first ones, by line)."""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses a runner has work in (and a lease to take)."""
FINAL = ("completed", "failed", "expired", "cancelled")
TIMESTAMPS = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
INTERRUPTED = "interrupted: server restarted before the batch line finished; rerun"
INTERRUPTED_AFTER_OK = ("interrupted: the server stopped after this attempt's ledger row and before its "
                        "output line was written; rerun")


class ExpiresAfter(BaseModel):
    """OpenAI's ``expires_after``: the file expires `seconds` after its `anchor` (its creation)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRES_AFTER_RANGE_S[0], le=EXPIRES_AFTER_RANGE_S[1])


class CreateBatchRequest(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("at most 16 key-value pairs")
        for key, value in v.items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys are at most 64 characters, values at most 512")
        return v


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    """OpenAI's batch object (times in Unix seconds)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                    "cancelling", "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class AttemptStillSpooled(RuntimeError):
    """A stale line's attempt has no ledger row yet, but its row waits in a ledger spool
    (``BatchStore.recover_lines``): recovery must wait for the replay."""


def batch_object(row: Mapping[str, Any]) -> dict:
    """The API's JSON for a ``batches`` row."""
    def t(name: str) -> int | None:
        v = row[name]
        return None if v is None else int(v)

    return {
        "id": row["batch_id"], "object": "batch", "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"], "created_at": int(row["created_at"]),
        "expires_at": t("expires_at"), **{f"{s}_at": t(f"{s}_at") for s in TIMESTAMPS},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def batch_not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(f"No such Batch object: {batch_id}", status_code=404, param="batch_id",
                       code="batch_not_found")


# ----------------------------------------------------------------- validation


def parse_batch_input(content: bytes, endpoint: str) -> tuple[list[tuple[str, dict]], list[dict]]:
    """The lines of a batch input file.

    Returns:
      ([(custom_id, body), ...] in file order, []) when every line is valid,
      else ([], errors): OpenAI's batch errors ``{"code", "message", "param",
      "line"}`` (1-based line numbers), at most :data:`MAX_REPORTED_ERRORS`.
      Blank lines are skipped.
    """
    errors: list[dict] = []

    def bad(code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(errors) < MAX_REPORTED_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        bad("invalid_file_format", f"The input file is not UTF-8 text ({e.reason} at byte {e.start}).")
        return [], errors
    out: list[tuple[str, dict]] = []
    seen: set[str] = set()
    numbered = [(n, raw) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not numbered:
        bad("empty_file", "The input file has no requests.")
    if len(numbered) > MAX_LINES:
        bad("too_many_requests", f"The input file has {len(numbered)} requests; a batch holds at most "
                                 f"{MAX_LINES}.")
        return [], errors
    for n, raw in numbered:
        try:
            item = json.loads(raw)
        except ValueError as e:
            bad("invalid_json_line", f"Line {n} is not valid JSON ({e}).", n)
            continue
        if not isinstance(item, dict):
            bad("invalid_json_line", f"Line {n} is not a JSON object.", n)
            continue
        missing = [k for k in ("custom_id", "method", "url", "body") if k not in item]
        if missing:
            bad("missing_required_parameter", f"Line {n} lacks {', '.join(repr(k) for k in missing)}.",
                n, missing[0])
            continue
        custom_id, body = item["custom_id"], item["body"]
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            bad("invalid_custom_id", f"Line {n}: 'custom_id' must be a non-empty string of at most "
                                     "512 characters.", n, "custom_id")
        elif custom_id in seen:
            bad("duplicate_custom_id", f"Line {n}: the custom_id {custom_id!r} is used by an earlier "
                                       "line; each request needs its own.", n, "custom_id")
        elif item["method"] != "POST":
            bad("invalid_method", f"Line {n}: 'method' must be 'POST'.", n, "method")
        elif item["url"] != endpoint:
            bad("mismatched_url", f"Line {n}: 'url' is {item['url']!r}, but the batch's endpoint is "
                                  f"{endpoint!r}.", n, "url")
        elif not isinstance(body, dict):
            bad("invalid_body", f"Line {n}: 'body' must be a JSON object.", n, "body")
        else:
            seen.add(custom_id)
            out.append((custom_id, body))
    return ([], errors) if errors else (out, [])


# ----------------------------------------------------------------- storage


class BatchStore:
    """Batches and their lines in the gateway database. Every method blocks on it
    (call from a worker thread). Leases are stamped and compared by the database's
    clock (``database_time``); other times (timestamps, the completion window) come
    from `clock` (Unix seconds), which tests replace to move past the completion
    window without waiting.

    Args:
      engine: a SQLAlchemy engine (tables created; see ``database.py``).
      files: where input files are read and output files written.
      clock: Unix seconds now (None: the database's clock, ``database_clock``).
      settle: brings the ledger spools this gateway can reach into the database and
        returns the X-Request-IDs still spooled (``ledger_instances.settle_spools``);
        :meth:`recover_lines` calls it before taking an attempt without a ledger row
        for one that never ran (None: no spool, nothing to settle).
    """

    def __init__(self, engine: sa.Engine, files: FileStore, clock: Callable[[], float] | None = None,
                 settle: Callable[[], set[str]] | None = None) -> None:
        self.engine = engine
        self.files = files
        self.clock = clock or database_clock(engine)
        self.settle = settle

    # -- the API's side ------------------------------------------------------

    def create(self, tenant: str, key_id: str | None, endpoint: str, input_file_id: str,
               completion_window: str, metadata: Mapping[str, str] | None,
               output_expires_after_s: float | None = None) -> dict:
        """A new batch in status ``validating``; returns its row.

        Args:
          output_expires_after_s: its output and error files expire this many seconds
            after they are written (None: kept until deleted).

        Raises:
          OpenAIError: 429 ``quota_exceeded`` (``batches``) when the tenant already has its
            quota of unfinished batches (``storage_quotas.py``).
        """
        now = self.clock()
        row = dict(batch_id="batch_" + uuid.uuid4().hex, tenant=tenant, key_id=key_id, endpoint=endpoint,
                   input_file_id=input_file_id, status="validating", completion_window=completion_window,
                   metadata=json.dumps(dict(metadata)) if metadata else None, created_at=now,
                   expires_at=now + COMPLETION_WINDOW_S[completion_window], total=0, completed=0, failed=0,
                   output_expires_after_s=output_expires_after_s)
        with self.engine.begin() as conn:
            if self.files.quotas is not None:
                check_batch_quota(conn, self.files.quotas(tenant), tenant)
            conn.execute(batches.insert().values(**row))
            return dict(conn.execute(sa.select(batches).where(batches.c.batch_id == row["batch_id"]))
                        .mappings().one())

    def get(self, batch_id: str, tenant: str | None = None) -> dict | None:
        """The row of batch `batch_id` (of `tenant`, unless None), or None."""
        q = sa.select(batches).where(batches.c.batch_id == batch_id)
        if tenant is not None:
            q = q.where(batches.c.tenant == tenant)
        with self.engine.connect() as conn:
            row = conn.execute(q).mappings().first()
        return None if row is None else dict(row)

    def list(self, tenant: str, limit: int = 20, after: str | None = None) -> tuple[list[dict], bool]:
        """(rows, has_more) of `tenant`'s batches, newest first."""
        with self.engine.connect() as conn:
            return cursor_page(conn, batches, "batch_id", batches.c.tenant == tenant, limit, after)

    def request_cancel(self, batch_id: str, tenant: str) -> dict | None:
        """Moves an unfinished batch to ``cancelling`` (the runner finishes the job).

        Returns:
          The batch's row (unchanged when already cancelling or cancelled), or
          None when `tenant` has no such batch.

        Raises:
          OpenAIError: 409 for a completed, failed or expired batch.
        """
        with self.engine.begin() as conn:
            conn.execute(batches.update().where(
                batches.c.batch_id == batch_id, batches.c.tenant == tenant,
                batches.c.status.in_(("validating", "in_progress", "finalizing")))
                .values(status="cancelling", cancelling_at=self.clock()))
            row = conn.execute(sa.select(batches).where(
                batches.c.batch_id == batch_id, batches.c.tenant == tenant)).mappings().first()
        if row is None:
            return None
        if row["status"] in ("completed", "failed", "expired"):
            raise OpenAIError(f"Cannot cancel a batch with status {row['status']!r}.", status_code=409,
                              param="batch_id", code="batch_not_cancellable")
        return dict(row)

    # -- the runner's side: the lease ------------------------------------------

    def claimable(self, limit: int = 16) -> list[str]:
        """Ids of batches with work to do whose lease is free or expired (by the database's
        clock, as every lease decision), oldest first."""
        with self.engine.connect() as conn:
            now = database_time(conn)
            return list(conn.execute(
                sa.select(batches.c.batch_id)
                .where(batches.c.status.in_(ACTIVE),
                       sa.or_(batches.c.lease_owner.is_(None), batches.c.lease_expires_at < now))
                .order_by(batches.c.created_at).limit(limit)).scalars())

    def claim(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Takes the lease of `batch_id` for `lease_s` seconds if it is free or expired
        (one conditional UPDATE: of several gateways racing, one wins). Expired by the
        database's clock, never this machine's: a gateway whose clock runs ahead cannot take
        a live lease."""
        with self.engine.begin() as conn:
            now = database_time(conn)
            res = conn.execute(batches.update().where(
                batches.c.batch_id == batch_id, batches.c.status.in_(ACTIVE),
                sa.or_(batches.c.lease_owner.is_(None), batches.c.lease_expires_at < now))
                .values(lease_owner=owner, lease_expires_at=now + lease_s))
        return res.rowcount == 1

    def renew(self, batch_id: str, owner: str, lease_s: float) -> dict | None:
        """Extends `owner`'s lease; returns the batch's row, or None if the lease was lost."""
        with self.engine.begin() as conn:
            res = conn.execute(batches.update().where(batches.c.batch_id == batch_id,
                                                      batches.c.lease_owner == owner)
                               .values(lease_expires_at=database_time(conn) + lease_s))
            if res.rowcount != 1:
                return None
            return dict(conn.execute(sa.select(batches).where(batches.c.batch_id == batch_id))
                        .mappings().one())

    def release(self, batch_id: str, owner: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(batches.update().where(batches.c.batch_id == batch_id,
                                                batches.c.lease_owner == owner)
                         .values(lease_owner=None, lease_expires_at=None))

    def _set(self, conn: sa.Connection, batch_id: str, owner: str, from_status: str | None = None,
             **values: Any) -> bool:
        """Updates the batch if `owner` holds its lease (and it is in `from_status`, when given)."""
        q = batches.update().where(batches.c.batch_id == batch_id, batches.c.lease_owner == owner)
        if from_status is not None:
            q = q.where(batches.c.status == from_status)
        return conn.execute(q.values(**values)).rowcount == 1

    # -- the runner's side: states -----------------------------------------------

    def validate(self, batch_id: str, owner: str, endpoint: str) -> str:
        """Checks the input file of a ``validating`` batch: its lines are stored
        and the batch goes ``in_progress``, or it goes ``failed`` with errors.

        Returns:
          The new status (the old one when the lease was lost).
        """
        row = self.get(batch_id)
        content = self.files.content(row["input_file_id"], row["tenant"])
        if content is None:
            lines, errors = [], [{"code": "file_not_found", "param": "input_file_id", "line": None,
                                  "message": f"The input file {row['input_file_id']} no longer exists."}]
        else:
            lines, errors = parse_batch_input(bytes(content), endpoint)
        now = self.clock()
        with self.engine.begin() as conn:
            if errors:
                ok = self._set(conn, batch_id, owner, status="failed", failed_at=now, lease_owner=None,
                               errors=json.dumps({"object": "list", "data": errors}))
                return "failed" if ok else row["status"]
            if not self._set(conn, batch_id, owner, status="in_progress", in_progress_at=now,
                             total=len(lines)):
                return row["status"]  # nothing was written
            conn.execute(batch_lines.delete().where(batch_lines.c.batch_id == batch_id))
            for start in range(0, len(lines), 1000):
                conn.execute(batch_lines.insert(), [
                    dict(batch_id=batch_id, line_no=start + i, custom_id=cid, body=json.dumps(body),
                         status="pending", attempts="[]")
                    for i, (cid, body) in enumerate(lines[start:start + 1000])])
        return "in_progress"

    def recover_lines(self, batch_id: str) -> int:
        """Lines left ``running`` by a gateway that stopped: their attempt's ledger row,
        if still "running" or already reconciled as "interrupted" (or "ok" without an
        output line), becomes "cancelled" with
        the reason, and the line is pending again, to be rerun. An attempt that stopped
        before its request was admitted (no ledger row: nothing ran, nothing to meter)
        is struck from the line's attempts, so every attempt listed has a ledger row.

        A missing row may only be late: its writes may wait in a ledger spool (the
        database was away while the attempt ran). So before striking, the spools are
        settled (``settle``): a row that arrives is cancelled as above; an attempt whose
        row is still spooled somewhere keeps the line as it is and this raises, for the
        runner to try again later, rather than run the line again and bill it twice.

        Returns:
          How many lines.

        Raises:
          AttemptStillSpooled: a running line's attempt has no row and its row is in a
            spool that could not be replayed now (nothing was changed).
        """
        if self.settle is not None and self._unadmitted_attempts(batch_id):
            still_spooled = self.settle()
        else:
            still_spooled = set()
        now = self.clock()
        with self.engine.begin() as conn:
            stale = conn.execute(sa.select(batch_lines.c.line_no, batch_lines.c.attempt_id,
                                           batch_lines.c.attempts).where(
                batch_lines.c.batch_id == batch_id, batch_lines.c.status == "running")).all()
            for line_no, attempt, attempts in stale:
                for status, reason in (("running", INTERRUPTED), ("interrupted", INTERRUPTED),
                                       ("ok", INTERRUPTED_AFTER_OK)):
                    conn.execute(requests_table.update().where(
                        requests_table.c.x_request_id == attempt, requests_table.c.status == status)
                        .values(status="cancelled", error=reason, finished_at=now))
                admitted = conn.execute(sa.select(sa.func.count()).select_from(requests_table).where(
                    requests_table.c.x_request_id == attempt)).scalar_one()
                listed = json.loads(attempts or "[]")
                if not admitted and attempt in still_spooled:
                    raise AttemptStillSpooled(
                        f"batch {batch_id} line {line_no}: the ledger row of attempt {attempt} waits in a "
                        "ledger spool; the line is recovered once it is replayed")
                if not admitted:
                    listed = [a for a in listed if a != attempt]
                conn.execute(batch_lines.update().where(batch_lines.c.batch_id == batch_id,
                                                        batch_lines.c.line_no == line_no)
                             .values(status="pending", attempt_id=None, attempts=json.dumps(listed)))
        return len(stale)

    def _unadmitted_attempts(self, batch_id: str) -> bool:
        """Whether a running line's attempt has no ledger row."""
        with self.engine.connect() as conn:
            admitted = sa.select(requests_table.c.x_request_id).where(
                requests_table.c.x_request_id == batch_lines.c.attempt_id).exists()
            return conn.execute(sa.select(sa.func.count()).select_from(batch_lines).where(
                batch_lines.c.batch_id == batch_id, batch_lines.c.status == "running",
                ~admitted)).scalar_one() > 0

    def pending_lines(self, batch_id: str, limit: int) -> list[dict]:
        """Up to `limit` pending lines, in file order."""
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(
                sa.select(batch_lines).where(batch_lines.c.batch_id == batch_id,
                                             batch_lines.c.status == "pending")
                .order_by(batch_lines.c.line_no).limit(limit)).mappings()]

    def start_attempt(self, batch_id: str, line_no: int, attempt: str) -> None:
        """Records that `attempt` (its X-Request-ID) of a line runs now, before its
        ledger row exists, so a restart can find and settle that row."""
        with self.engine.begin() as conn:
            attempts = conn.execute(sa.select(batch_lines.c.attempts).where(
                batch_lines.c.batch_id == batch_id, batch_lines.c.line_no == line_no)).scalar_one()
            conn.execute(batch_lines.update().where(batch_lines.c.batch_id == batch_id,
                                                    batch_lines.c.line_no == line_no)
                         .values(status="running", attempt_id=attempt,
                                 attempts=json.dumps([*json.loads(attempts or "[]"), attempt])))

    def end_attempt(self, batch_id: str, line_no: int, attempt: str, status: str,
                    outcome: dict | None = None) -> None:
        """Ends a running line's attempt in one transaction with its counts.

        Args:
          status: "succeeded" / "failed" (an output / error line, `outcome`),
            "pending" (to run again: rate limited, engine full) or "cancelled".
        """
        with self.engine.begin() as conn:
            res = conn.execute(batch_lines.update().where(
                batch_lines.c.batch_id == batch_id, batch_lines.c.line_no == line_no,
                batch_lines.c.status == "running", batch_lines.c.attempt_id == attempt)
                .values(status=status, outcome=None if outcome is None else json.dumps(outcome),
                        finished_at=self.clock() if status in ("succeeded", "failed") else None))
            if res.rowcount == 1 and status in ("succeeded", "failed"):
                col = "completed" if status == "succeeded" else "failed"
                conn.execute(batches.update().where(batches.c.batch_id == batch_id)
                             .values({col: batches.c[col] + 1}))

    def expire_lines(self, batch_id: str) -> None:
        """Unfinished lines of an expired batch become ``batch_expired`` error lines."""
        now = self.clock()
        with self.engine.begin() as conn:
            rows = conn.execute(sa.select(batch_lines.c.line_no, batch_lines.c.custom_id).where(
                batch_lines.c.batch_id == batch_id,
                batch_lines.c.status.in_(("pending", "running", "cancelled")))).all()
            for line_no, custom_id in rows:
                outcome = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                           "error": {"code": "batch_expired", "message": "This request could not be "
                                     "executed before the completion window expired."}}
                conn.execute(batch_lines.update().where(batch_lines.c.batch_id == batch_id,
                                                        batch_lines.c.line_no == line_no)
                             .values(status="failed", outcome=json.dumps(outcome), finished_at=now))
            if rows:
                conn.execute(batches.update().where(batches.c.batch_id == batch_id)
                             .values(failed=batches.c.failed + len(rows)))

    def finish(self, batch_id: str, owner: str, status: str, from_status: str | None = None,
               **values: Any) -> bool:
        """Writes the output and error files of the finished lines and ends the batch
        in `status` (completed, expired, cancelled or failed) with its timestamp and
        `values`, releasing the lease, all in one transaction.

        Returns:
          False (nothing written) if the lease was lost or the batch is no longer
          in `from_status` (e.g. cancelled meanwhile).
        """
        row = self.get(batch_id)
        with self.engine.begin() as conn:
            out: dict[str, list[str]] = {"succeeded": [], "failed": []}
            for line_status, outcome in conn.execute(
                    sa.select(batch_lines.c.status, batch_lines.c.outcome).where(
                        batch_lines.c.batch_id == batch_id,
                        batch_lines.c.status.in_(("succeeded", "failed"))).order_by(batch_lines.c.line_no)):
                out[line_status].append(outcome + "\n")
            if not self._set(conn, batch_id, owner, from_status, status=status, lease_owner=None,
                             lease_expires_at=None, **{f"{status}_at": self.clock()}, **values):
                return False  # nothing was written
            ids = {}
            for kind, lines in (("output", out["succeeded"]), ("error", out["failed"])):
                if lines:
                    ids[f"{kind}_file_id"] = self.files.create(
                        row["tenant"], "batch_output", f"{batch_id}_{kind}.jsonl",
                        "".join(lines).encode("utf-8"), conn=conn,
                        expires_after_s=row.get("output_expires_after_s"))["file_id"]
            if ids:
                conn.execute(batches.update().where(batches.c.batch_id == batch_id).values(**ids))
        return True

    def set_status(self, batch_id: str, owner: str, status: str, from_status: str | None = None) -> bool:
        """Moves the batch to `status` (stamping ``<status>_at``) while `owner` holds its
        lease and the batch is in `from_status` (when given)."""
        with self.engine.begin() as conn:
            return self._set(conn, batch_id, owner, from_status, status=status,
                             **{f"{status}_at": self.clock()})

    def lines(self, batch_id: str) -> list[dict]:
        """Every line of a batch, in file order (for tests and operators)."""
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(sa.select(batch_lines).where(
                batch_lines.c.batch_id == batch_id).order_by(batch_lines.c.line_no)).mappings()]


# ----------------------------------------------------------------- routes


def install_batch_routes(app: FastAPI, store: Callable[[], BatchStore], principal: Callable,
                         endpoints: Callable[[], Mapping[str, Any]],
                         wake: Callable[[], None] = lambda: None) -> None:
    """Adds the ``/v1/batches`` routes to `app`.

    Args:
      store: returns the batch store (raising OpenAIError 404 ``no_ledger``
        when the server keeps no database).
      principal: the FastAPI dependency that authenticates the caller.
      endpoints: returns the endpoints with a handler (the batch runner's table).
      wake: called after a create or cancel, so the runner looks at once.
    """

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args))

    @app.post(BATCHES_PATH, response_model=BatchObject, openapi_extra=json_request_body(CreateBatchRequest),
              responses=error_responses(400, 401, 403, 404, 413, 415, 429))
    async def create_batch(request: Request, caller: Principal = Depends(principal)) -> Response:
        batches_ = store()
        req = CreateBatchRequest.model_validate(await read_json(request))
        known = [e for e in BATCH_ENDPOINTS if e in endpoints()]
        if req.endpoint not in known:
            raise OpenAIError(f"'endpoint' must be one of {', '.join(known)}; got {req.endpoint!r}.",
                              param="endpoint")
        file = await run(batches_.files.get, req.input_file_id, caller.tenant)
        if file is None:
            raise file_not_found(req.input_file_id, "input_file_id")
        if file["purpose"] != "batch":
            raise OpenAIError(f"The file {req.input_file_id} has purpose {file['purpose']!r}; a batch "
                              "needs a file uploaded with purpose 'batch'.", param="input_file_id")
        expires = req.output_expires_after
        row = await run(batches_.create, caller.tenant, caller.key_id, req.endpoint, req.input_file_id,
                        req.completion_window, req.metadata, None if expires is None else float(expires.seconds))
        wake()
        return JSONResponse(batch_object(row))

    @app.get(BATCHES_PATH, response_model=BatchList, responses=error_responses(400, 401, 403, 404, 413))
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None,
                           caller: Principal = Depends(principal)) -> Response:
        rows, has_more = await run(store().list, caller.tenant, limit, after)
        return JSONResponse(list_page([batch_object(r) for r in rows], has_more))

    @app.get(BATCHES_PATH + "/{batch_id}", response_model=BatchObject,
             responses=error_responses(401, 403, 404, 413))
    async def retrieve_batch(batch_id: str, caller: Principal = Depends(principal)) -> Response:
        row = await run(store().get, batch_id, caller.tenant)
        if row is None:
            raise batch_not_found(batch_id)
        return JSONResponse(batch_object(row))

    @app.post(BATCHES_PATH + "/{batch_id}/cancel", response_model=BatchObject,
              responses=error_responses(401, 403, 404, 409, 413))
    async def cancel_batch(batch_id: str, caller: Principal = Depends(principal)) -> Response:
        row = await run(store().request_cancel, batch_id, caller.tenant)
        if row is None:
            raise batch_not_found(batch_id)
        wake()
        return JSONResponse(batch_object(row))
