"""The batch runner: each gateway's worker loop that runs batches under a lease.

Every gateway runs one :class:`BatchRunner` (started with the app). It polls
the database for batches with work (``validating``, ``in_progress``,
``finalizing``, ``cancelling``) whose lease is free or expired, takes one with a
conditional UPDATE (``BatchStore.claim``: of several gateways sharing the
database, one wins), renews the lease every third of ``lease_seconds`` while it
works, and releases it when the batch ends. A gateway that dies holds its
batches at most ``lease_seconds`` longer; then another gateway, or the
restarted one, takes them over.

Lines run through the same handlers as HTTP requests
(``OpenAIServing.create_chat_completion`` and friends: authentication's
principal, rate limits, metering, tracing, policies), with a synthetic request
whose body is the line's with ``"priority": "batch"`` and ``"stream": false``
forced: the engine admits them only with spare capacity and preempts them
first, and the ledger prices them with the batch discount. Up to
``concurrency`` lines run at once per gateway, so the engine always has batch
work queued. The batch owner's key is resolved again at run time: a revoked
key's batch fails. A line rate limited (429) or refused by a full engine (503)
waits its ``Retry-After`` (0.5..30 s) and runs again.

Exactly once, across crashes: before an attempt runs, its id (the X-Request-ID
of its ledger row) is recorded on the line (``running``); the output line and
the line's end are written in one transaction. A runner taking over a batch
finds lines left ``running``: their attempt's ledger row, if still "running",
or "ok" but without an output line (the server stopped between the two
writes), becomes "cancelled" with the reason, and the line runs again with a
new attempt. An attempt without a ledger row is struck (it never ran) only after
the ledger spools this host reaches are replayed (``ledger_instances.settle_spools``);
one whose row a live gateway still spools holds the batch back
(``AttemptStillSpooled``: the lease is released and recovery tried again later). So
every ``custom_id`` ends with exactly one "ok" ledger row and one output line. (If a gateway only *lost* its lease, e.g. a database stall
longer than the lease, it stops its lines at its next renewal; a line that it
finishes meanwhile may be run twice.)

Each poll also deletes the files past their ``expires_at`` (``FileStore.sweep_expired``;
the API hides them at once).

Cancellation (``cancelling``) and expiry (``expires_at`` passed: ``expired``)
are seen at the next renewal (or at once when this gateway's routes call
:meth:`BatchRunner.wake`): running lines are disconnected (their ledger rows
"cancelled"), pending ones are not run (expired ones become ``batch_expired``
error lines), and the batch ends with the files of what finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import uuid
from typing import Any, Awaitable, Callable, Mapping

import anyio
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from serving.gateway.accounts.api_keys import ANONYMOUS, Principal
from serving.gateway.accounts.database import database_clock
from serving.gateway.batch.batches import AttemptStillSpooled, BatchStore, install_batch_routes
from serving.gateway.batch.files import FileStore, install_file_routes
from serving.gateway.http.errors import SERVER_ERROR, OpenAIError, error_response
from serving.gateway.http.log_context import request_id_var
from serving.gateway.http.request_scope import REQUEST_ID_GIVEN_SCOPE_KEY, REQUEST_ID_SCOPE_KEY

logger = logging.getLogger("xlaserve.batch")

Handler = Callable[[Request, Principal], Awaitable[Response]]
"""A route's handler: ``(request, principal) -> response`` (may raise the app's handled errors)."""

DEFAULT_BATCH_CONCURRENCY = 8
DEFAULT_BATCH_LEASE_S = 30.0
RETRY_STATUSES = (429, 503)
MIN_RETRY_S, MAX_RETRY_S = 0.5, 30.0


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """How a gateway runs batches.

    Attributes:
      concurrency: batch lines this gateway runs at once (all batches together).
      lease_seconds: how long a batch's lease lasts unrenewed (renewed every third of it).
      poll_seconds: how often the database is polled for batches (None: a sixth
        of the lease, at most 5 s).
      clock: Unix seconds now, for every batch timestamp and the 24 h window (None: the
        database's clock, so gateways whose clocks disagree agree; tests pass a fake one to
        expire a batch without waiting). Leases always go by the database's clock.

    Raises:
      ValueError: a value that is not positive.
    """

    concurrency: int = DEFAULT_BATCH_CONCURRENCY
    lease_seconds: float = DEFAULT_BATCH_LEASE_S
    poll_seconds: float | None = None
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        for name in ("concurrency", "lease_seconds", "poll_seconds"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"batch {name} must be positive, got {value!r}")

    @property
    def poll(self) -> float:
        return self.poll_seconds if self.poll_seconds is not None else min(5.0, self.lease_seconds / 6)


class _Waker:
    """Lets any number of waiters sleep until a timeout or :meth:`wake`."""

    def __init__(self) -> None:
        self._fut: asyncio.Future | None = None

    def wake(self) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(None)
        self._fut = None

    async def wait(self, timeout: float) -> None:
        if self._fut is None:
            self._fut = asyncio.get_running_loop().create_future()
        # asyncio.wait, not wait_for: Python 3.11's wait_for swallows a cancellation that
        # arrives as the future completes, and then the waiting task never stops.
        await asyncio.wait({self._fut}, timeout=timeout)


async def _wait_event(event: asyncio.Event, timeout: float) -> None:
    """Waits until `event` is set or `timeout` seconds pass."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()


@dataclasses.dataclass
class _Job:
    """One batch this gateway holds the lease of."""

    batch_id: str
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # lines disconnect
    reason: str | None = None  # "cancelled", "expired", "revoked", "lost", "shutdown"

    def halt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop.set()


class BatchRunner:
    """Runs the batches of the database this gateway shares (see the module docstring).

    Args:
      store: the batch store.
      endpoints: handler per batch endpoint (``/v1/chat/completions`` ...).
      principal_of: the principal of a batch's key id at run time; None for a
        revoked or deleted key. Blocking (called in a worker thread).
      respond: turns an exception a handler raised into its HTTP response (the
        app's exception handlers).
      settings: concurrency, lease, clock.
    """

    def __init__(self, store: BatchStore, endpoints: Mapping[str, Handler],
                 principal_of: Callable[[str | None], Principal | None],
                 respond: Callable[[Request, Exception], Awaitable[Response]],
                 settings: BatchSettings = BatchSettings()) -> None:
        self.store = store
        self.endpoints = dict(endpoints)
        self.principal_of = principal_of
        self.respond = respond
        self.settings = settings
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._jobs: dict[str, tuple[_Job, asyncio.Task]] = {}
        self._waker = _Waker()
        self._task: asyncio.Task | None = None
        self._slots: asyncio.Semaphore | None = None

    async def _db(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Starts the poll loop on the running event loop."""
        self._slots = asyncio.Semaphore(self.settings.concurrency)
        self._task = asyncio.create_task(self._loop(), name="xlaserve-batch-runner")

    async def stop(self, timeout: float = 10.0) -> None:
        """Stops polling, disconnects running lines and releases the leases held."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for job, _ in self._jobs.values():
            job.halt("shutdown")
        tasks = [t for _, t in self._jobs.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def wake(self) -> None:
        """Look for work and re-read held batches' states now (after a create or cancel)."""
        self._waker.wake()

    async def _loop(self) -> None:
        while True:
            try:
                swept = await self._db(self.store.files.sweep_expired)
                if swept:
                    logger.info("%d expired files deleted", swept)
            except Exception:
                logger.exception("sweeping expired files failed")
            try:
                for batch_id in await self._db(self.store.claimable):
                    if batch_id in self._jobs:
                        continue
                    if await self._db(self.store.claim, batch_id, self.owner, self.settings.lease_seconds):
                        job = _Job(batch_id)
                        self._jobs[batch_id] = (job, asyncio.create_task(self._run(job)))
            except Exception:
                logger.exception("batch poll failed")
            await self._waker.wait(self.settings.poll)

    # ---------------------------------------------------------------- one batch

    async def _run(self, job: _Job) -> None:
        keeper = asyncio.create_task(self._keep_lease(job))
        try:
            await self._drive(job)
        except AttemptStillSpooled as e:
            logger.warning("%s; the lease is released for a later try", e)
        except Exception:
            logger.exception("batch %s: runner error; the lease is released for a later try", job.batch_id)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            if job.reason != "lost":
                with anyio.CancelScope(shield=True):
                    await self._db(self.store.release, job.batch_id, self.owner)
            self._jobs.pop(job.batch_id, None)

    async def _keep_lease(self, job: _Job) -> None:
        """Renews the lease and watches for cancellation, expiry and a revoked key."""
        while True:
            await self._waker.wait(self.settings.lease_seconds / 3)
            row = await self._db(self.store.renew, job.batch_id, self.owner, self.settings.lease_seconds)
            if row is None:
                logger.warning("batch %s: lease lost; stopping its lines", job.batch_id)
                job.halt("lost")
                return
            if row["status"] == "cancelling":
                job.halt("cancelled")
            elif row["status"] == "in_progress" and await self._db(self.store.clock) >= row["expires_at"]:
                job.halt("expired")
            elif await self._db(self.principal_of, row["key_id"]) is None:
                job.halt("revoked")

    async def _drive(self, job: _Job) -> None:
        bid, owner, store = job.batch_id, self.owner, self.store
        while job.reason not in ("lost", "shutdown"):
            row = await self._db(store.get, bid)
            status = row["status"]
            if status in ("validating", "in_progress") and await self._db(store.clock) >= row["expires_at"]:
                await self._db(store.recover_lines, bid)
                await self._db(store.expire_lines, bid)
                await self._db(store.finish, bid, owner, "expired", from_status=status)
                continue
            if status in ("validating", "in_progress") and (
                    job.reason == "revoked" or await self._db(self.principal_of, row["key_id"]) is None):
                await self._db(store.recover_lines, bid)
                errors = {"object": "list", "data": [{
                    "code": "api_key_revoked", "param": None, "line": None,
                    "message": "The API key that created this batch was revoked or deleted."}]}
                await self._db(store.finish, bid, owner, "failed", from_status=status,
                               errors=json.dumps(errors))
                continue
            if status == "validating":
                await self._db(store.validate, bid, owner, row["endpoint"])
            elif status == "in_progress":
                await self._db(store.recover_lines, bid)
                principal = await self._db(self.principal_of, row["key_id"])
                await self._run_lines(job, row, principal)
                if job.reason is None:
                    await self._db(store.set_status, bid, owner, "finalizing", from_status="in_progress")
                elif job.reason == "expired":
                    await self._db(store.expire_lines, bid)
                    await self._db(store.finish, bid, owner, "expired", from_status="in_progress")
                elif job.reason == "cancelled":
                    job.reason, job.stop = None, asyncio.Event()  # the next state is read from the row
            elif status == "finalizing":
                await self._db(store.finish, bid, owner, "completed", from_status="finalizing")
            elif status == "cancelling":
                await self._db(store.recover_lines, bid)
                await self._db(store.finish, bid, owner, "cancelled", from_status="cancelling")
            else:
                return

    async def _run_lines(self, job: _Job, batch: dict, principal: Principal) -> None:
        """Runs the pending lines, `concurrency` at a time, until none is left or the job halts."""
        handler = self.endpoints[batch["endpoint"]]
        running: set[asyncio.Task] = set()
        halted = asyncio.ensure_future(job.stop.wait())
        exhausted = False
        try:
            while not job.stop.is_set():
                free = self.settings.concurrency - len(running)
                if free > 0 and not exhausted:
                    lines = await self._db(self.store.pending_lines, job.batch_id, free)
                    exhausted = len(lines) < free
                    for line in lines:
                        attempt = _attempt_id()
                        await self._db(self.store.start_attempt, job.batch_id, line["line_no"], attempt)
                        running.add(asyncio.create_task(
                            self._run_line(job, batch["endpoint"], handler, line, attempt, principal)))
                if not running:
                    if exhausted:
                        return
                    continue
                done, _ = await asyncio.wait(running | {halted}, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {halted}:
                    running.discard(task)
                    if not task.cancelled() and task.exception() is not None:
                        logger.error("batch %s: a line failed: %r", job.batch_id, task.exception())
                    exhausted = False  # a line set back to pending, or room for more
        finally:
            halted.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    async def _run_line(self, job: _Job, endpoint: str, handler: Handler, line: dict, attempt: str,
                        principal: Principal) -> None:
        bid, line_no = job.batch_id, line["line_no"]
        body = json.loads(line["body"])
        body.update(priority="batch", stream=False)
        body.pop("stream_options", None)
        raw = json.dumps(body).encode("utf-8")
        while True:
            async with self._slots:
                status, payload, retry_after = await self._call(handler, endpoint, raw, attempt, principal, job)
            if job.reason == "lost":
                return  # another gateway owns the batch now: write nothing
            if status in RETRY_STATUSES and not job.stop.is_set():
                await _wait_event(job.stop, min(MAX_RETRY_S, max(MIN_RETRY_S, retry_after)))
                if not job.stop.is_set():
                    await self._db(self.store.end_attempt, bid, line_no, attempt, "pending")
                    return  # the batch loop picks it up again with a new attempt
            if status == 499 or (status in RETRY_STATUSES and job.stop.is_set()):
                # Shutting down: the line runs again (here after a restart, or elsewhere).
                again = "pending" if job.reason == "shutdown" else "cancelled"
                await self._db(self.store.end_attempt, bid, line_no, attempt, again)
                return
            outcome = {"id": attempt, "custom_id": line["custom_id"],
                       "response": {"status_code": status, "request_id": attempt, "body": payload},
                       "error": None}
            await self._db(self.store.end_attempt, bid, line_no, attempt,
                           "succeeded" if 200 <= status < 300 else "failed", outcome)
            return

    async def _call(self, handler: Handler, endpoint: str, raw: bytes, attempt: str, principal: Principal,
                    job: _Job) -> tuple[int, Any, float]:
        """Runs one attempt through `handler`. Returns (status, JSON body, Retry-After seconds);
        499 when the job halted it (the request was metered as cancelled)."""
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await job.stop.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": endpoint, "raw_path": endpoint.encode(), "root_path": "",
                 "query_string": b"", "client": None, "server": None, "state": {},
                 "headers": [(b"content-type", b"application/json"), (b"x-request-id", attempt.encode()),
                             (b"content-length", str(len(raw)).encode())],
                 REQUEST_ID_SCOPE_KEY: attempt, REQUEST_ID_GIVEN_SCOPE_KEY: False}
        request = Request(scope, receive)
        token = request_id_var.set(attempt)
        try:
            try:
                response = await handler(request, principal)
            except Exception as e:  # the app's handlers answer it as HTTP would
                response = await self.respond(request, e)
        finally:
            request_id_var.reset(token)
        try:
            payload = json.loads(response.body) if response.body else None
        except (ValueError, AttributeError):
            payload = None
        try:
            retry_after = float(response.headers.get("retry-after", MIN_RETRY_S))
        except ValueError:
            retry_after = MIN_RETRY_S
        return response.status_code, payload, retry_after


def _attempt_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


# ----------------------------------------------------------------- wiring


def install_batch_api(app: FastAPI, services, endpoints: Mapping[str, Handler], principal: Callable,
                      max_file_bytes: int | None, settings: BatchSettings | None = None) -> BatchRunner | None:
    """Adds the ``/v1/files`` and ``/v1/batches`` routes to `app` and builds the runner.

    Args:
      services: the gateway's services (the ledger's database holds files and
        batches; the key store resolves a batch's key at run time).
      endpoints: the handler of each endpoint a batch may name.
      principal: the FastAPI dependency that authenticates callers.
      max_file_bytes: the largest upload in bytes (None: unlimited).
      settings: concurrency, lease, clock (default :class:`BatchSettings`).

    Returns:
      The runner to start and stop with the app, or None when the server keeps
      no database (the routes then answer 404 ``no_ledger``). Also kept as
      ``app.state.batch_runner`` (and the stores as ``app.state.batch_store``,
      ``app.state.file_store``).
    """
    settings = settings or BatchSettings()
    runner = None
    file_store = batch_store = None
    if services.ledger is not None:
        clock = settings.clock or database_clock(services.ledger.engine)
        key_store = services.authenticator.key_store
        file_store = FileStore(services.ledger.engine, clock, None if key_store is None else key_store.quotas)
        settle = None
        if services.instance is not None and services.ledger.spool is not None:
            from serving.gateway.accounts.ledger_instances import settle_spools

            ledger, instance = services.ledger, services.instance

            def settle() -> set[str]:
                return settle_spools(ledger, instance)
        batch_store = BatchStore(services.ledger.engine, file_store, clock, settle)

        def principal_of(key_id: str | None) -> Principal | None:
            if key_id is None or key_store is None:
                return ANONYMOUS
            return key_store.principal(key_id)

        async def respond(request: Request, exc: Exception) -> Response:
            for kind in type(exc).__mro__:
                handle = app.exception_handlers.get(kind)
                if handle is not None and kind is not Exception:
                    return await handle(request, exc)
            logger.error("batch line %s: unexpected error", request.scope.get(REQUEST_ID_SCOPE_KEY),
                         exc_info=exc)
            return error_response(500, "The server had an error while processing your request.",
                                  type=SERVER_ERROR)

        runner = BatchRunner(batch_store, endpoints, principal_of, respond, settings)
    app.state.batch_runner, app.state.batch_store, app.state.file_store = runner, batch_store, file_store

    def need(store):
        def get():
            if store is None:
                raise OpenAIError("This server keeps no database for files and batches.", status_code=404,
                                  code="no_ledger")
            return store
        return get

    install_file_routes(app, need(file_store), principal, max_file_bytes)
    install_batch_routes(app, need(batch_store), principal, lambda: endpoints,
                         wake=runner.wake if runner is not None else lambda: None)
    return runner
