"""The gateway's database: API keys, tenants, the request ledger, files, batches and
stored responses.

One SQLAlchemy Core schema that runs on SQLite (the default: a WAL-mode file
under ``$XLASERVE_DATA_DIR``, shared by ``xlaserve serve`` and the ``keys`` /
``usage`` commands) and on PostgreSQL (a ``postgresql+psycopg://`` URL, for
several gateways sharing one ledger). Nothing here imports JAX.

Tables::

    tenants   name* | rpm | tpm | max_concurrent | models (JSON list or NULL = all) | created_at
              | service_tiers (JSON list or NULL = all)
              | max_file_bytes | max_files | max_batches (storage quotas, NULL = unlimited)
    api_keys  key_id* | tenant | name | key_hash (sha256, unique) | key_prefix | is_admin
              | rpm | tpm | max_concurrent | created_at | revoked_at
              | service_tiers (JSON list or NULL = all)
    requests  request_id* | x_request_id | tenant | key_id | model | priority | stream
              | status | finish_reason | error | created_at | day | first_token_at
              | finished_at | prompt_tokens | cached_tokens | completion_tokens
              | reasoning_tokens | tool_calls | queue_time_s | ttft_s | itl_mean_s
              | itl_max_s | e2e_s | cost_usd | trace (JSON) | gateway_instance | service_tier
    files     file_id* | tenant | purpose | filename | bytes | created_at | content (bytes)
              | expires_at (NULL = kept; expired files are gone for the API and swept)
    batches   batch_id* | tenant | key_id | endpoint | input_file_id | output_file_id
              | error_file_id | status | completion_window | metadata (JSON) | errors (JSON)
              | created_at | in_progress_at | finalizing_at | completed_at | failed_at
              | expired_at | cancelling_at | cancelled_at | expires_at | total | completed
              | failed | lease_owner | lease_expires_at | output_expires_after_s
    batch_lines  batch_id* | line_no* | custom_id | body (JSON) | status | attempt_id
              | attempts (JSON list) | outcome (JSON: the output or error line) | finished_at
    responses response_id* | tenant | model | created_at | previous_response_id
              | response (JSON: the response object) | history (JSON: the conversation's
              chat messages, this response's output included)
    audit     audit_id* | at | actor | action | target | details (JSON): who changed a key or a
              tenant, when and how (``key_audit.py``; written by ``xlaserve keys`` / ``tenants``
              and by the console)

Times are Unix seconds (float); durations are seconds; ``day`` is the UTC date
of ``created_at`` ("YYYY-MM-DD"), kept for grouping. A ``requests`` row is
written with status "running" at admission and completed at the end, so a
crashed server leaves visible incomplete rows rather than none. Files and
batches (``files.py``, ``batches.py``, ``batch_runner.py``) live here too, so
several gateways sharing one PostgreSQL see the same ones; a batch line's
``attempt_id`` is the X-Request-ID of its ledger row. Stored responses
(``response_store.py``) hold what ``previous_response_id`` continues.
A ``requests`` row's ``gateway_instance`` names the gateway process that
admitted it (``ledger_instances.py``), so a restart reconciles only the rows
of gateways that are gone (status "interrupted").

There are no migrations: :func:`open_database` creates missing tables, and adds
to an existing table the nullable columns it lacks (``ALTER TABLE ... ADD
COLUMN``, with their indexes; :data:`ADDED_COLUMNS` lists those added after
their table first shipped), so a database file from an older version keeps working.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Callable

import sqlalchemy as sa

DATABASE_URL_ENV = "XLASERVE_DATABASE_URL"

metadata = sa.MetaData()

tenants = sa.Table(
    "tenants", metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("rpm", sa.Integer, nullable=True),
    sa.Column("tpm", sa.Integer, nullable=True),
    sa.Column("max_concurrent", sa.Integer, nullable=True),
    sa.Column("models", sa.Text, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("service_tiers", sa.Text, nullable=True),
    # Storage quotas (api_keys.Quotas; NULL: unlimited).
    sa.Column("max_file_bytes", sa.BigInteger, nullable=True),
    sa.Column("max_files", sa.Integer, nullable=True),
    sa.Column("max_batches", sa.Integer, nullable=True),
)

api_keys = sa.Table(
    "api_keys", metadata,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("name", sa.String(256), nullable=True),
    sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("key_prefix", sa.String(16), nullable=False),
    sa.Column("is_admin", sa.Boolean, nullable=False, default=False),
    sa.Column("rpm", sa.Integer, nullable=True),
    sa.Column("tpm", sa.Integer, nullable=True),
    sa.Column("max_concurrent", sa.Integer, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=True),
    sa.Column("service_tiers", sa.Text, nullable=True),
)

requests = sa.Table(
    "requests", metadata,
    sa.Column("request_id", sa.String(128), primary_key=True),
    sa.Column("x_request_id", sa.String(256), nullable=True, index=True),
    sa.Column("tenant", sa.String(128), nullable=True, index=True),
    sa.Column("key_id", sa.String(32), nullable=True, index=True),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("priority", sa.String(16), nullable=False),
    sa.Column("stream", sa.Boolean, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("finish_reason", sa.String(32), nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("day", sa.String(10), nullable=False),
    sa.Column("first_token_at", sa.Float, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("prompt_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("cached_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("completion_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("reasoning_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("tool_calls", sa.Integer, nullable=False, default=0),
    sa.Column("queue_time_s", sa.Float, nullable=True),
    sa.Column("ttft_s", sa.Float, nullable=True),
    sa.Column("itl_mean_s", sa.Float, nullable=True),
    sa.Column("itl_max_s", sa.Float, nullable=True),
    sa.Column("e2e_s", sa.Float, nullable=True),
    sa.Column("cost_usd", sa.Float, nullable=False, default=0.0),
    sa.Column("trace", sa.Text, nullable=True),
    sa.Column("gateway_instance", sa.String(64), nullable=True, index=True),
    sa.Column("service_tier", sa.String(16), nullable=True),
)


files = sa.Table(
    "files", metadata,
    sa.Column("file_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("filename", sa.String(512), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("content", sa.LargeBinary, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True, index=True),  # NULL: kept until deleted
)

batches = sa.Table(
    "batches", metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("key_id", sa.String(32), nullable=True),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("output_file_id", sa.String(64), nullable=True),
    sa.Column("error_file_id", sa.String(64), nullable=True),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("completion_window", sa.String(8), nullable=False),
    sa.Column("metadata", sa.Text, nullable=True),
    sa.Column("output_expires_after_s", sa.Float, nullable=True),  # its output files' expires_after
    sa.Column("errors", sa.Text, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    *(sa.Column(f"{t}_at", sa.Float, nullable=True) for t in (
        "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("total", sa.Integer, nullable=False, default=0),
    sa.Column("completed", sa.Integer, nullable=False, default=0),
    sa.Column("failed", sa.Integer, nullable=False, default=0),
    sa.Column("lease_owner", sa.String(128), nullable=True),
    sa.Column("lease_expires_at", sa.Float, nullable=True),
)

batch_lines = sa.Table(
    "batch_lines", metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("line_no", sa.Integer, primary_key=True),
    sa.Column("custom_id", sa.String(512), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("attempt_id", sa.String(64), nullable=True),
    sa.Column("attempts", sa.Text, nullable=True),
    sa.Column("outcome", sa.Text, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
)


responses = sa.Table(
    "responses", metadata,
    sa.Column("response_id", sa.String(128), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("previous_response_id", sa.String(128), nullable=True),
    sa.Column("response", sa.Text, nullable=False),
    sa.Column("history", sa.Text, nullable=False),
)


audit = sa.Table(
    "audit", metadata,
    sa.Column("audit_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.Float, nullable=False, index=True),
    sa.Column("actor", sa.String(64), nullable=False),
    sa.Column("action", sa.String(32), nullable=False),
    sa.Column("target", sa.String(128), nullable=False),
    sa.Column("details", sa.Text, nullable=True),
)


def cursor_page(conn: sa.Connection, table: sa.Table, id_column: str, where, limit: int,
                after: str | None, descending: bool = True) -> tuple[list[dict], bool]:
    """One page of `table`'s rows matching `where`, ordered by (created_at, id).

    Args:
      after: the id of the last row of the previous page (None: the first page); an id
        that matches no row (under `where`) gives an empty page.
      descending: newest first (OpenAI's default order for lists).

    Returns:
      (rows as dicts, whether more rows follow).
    """
    idc, created = table.c[id_column], table.c.created_at
    q = sa.select(*(c for c in table.c if c.name != "content")).where(where)
    if after is not None:
        mark = conn.execute(sa.select(created).where(where, idc == after)).scalar()
        if mark is None:
            return [], False
        if descending:
            q = q.where(sa.or_(created < mark, sa.and_(created == mark, idc < after)))
        else:
            q = q.where(sa.or_(created > mark, sa.and_(created == mark, idc > after)))
    order = (created.desc(), idc.desc()) if descending else (created, idc)
    rows = [dict(r) for r in conn.execute(q.order_by(*order).limit(limit + 1)).mappings()]
    return rows[:limit], len(rows) > limit


def default_database_url() -> str:
    """``$XLASERVE_DATABASE_URL``, else SQLite at ``$XLASERVE_DATA_DIR/xlaserve.db``."""
    env = os.environ.get(DATABASE_URL_ENV)
    if env:
        return env
    from serving.config.server_config import data_dir

    d = data_dir()
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d / 'xlaserve.db'}"


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cur.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash in WAL mode
    cur.execute("PRAGMA busy_timeout=10000")  # the CLI and the server share the file
    cur.close()


def database_time(conn: sa.Connection) -> float:
    """Unix seconds now by the database server's clock (PostgreSQL's ``clock_timestamp()``,
    SQLite's ``julianday('now')``, which is this machine's; another dialect: this machine's),
    so gateways on machines whose clocks disagree agree on leases and expiries."""
    dialect = conn.dialect.name
    if dialect == "postgresql":
        return float(conn.execute(sa.text("SELECT EXTRACT(EPOCH FROM clock_timestamp())")).scalar_one())
    if dialect == "sqlite":
        return float(conn.execute(sa.text("SELECT (julianday('now') - 2440587.5) * 86400.0")).scalar_one())
    return time.time()


def database_clock(engine: sa.Engine) -> Callable[[], float]:
    """A clock reading :func:`database_time` (one round trip a call: call it from a worker thread)."""
    def now() -> float:
        with engine.connect() as conn:
            return database_time(conn)
    return now


_DISK_FULL_TEXT = ("database or disk is full", "no space left on device", "could not extend file",
                   "file too large", "disk full")
_DISK_FULL_SQLSTATE = "53100"  # PostgreSQL's disk_full


_SQLITE_STORAGE_ERRORS = ("SQLITE_FULL", "SQLITE_IOERR_WRITE")


def is_disk_full(error: BaseException) -> bool:
    """True when `error` means the database's storage refuses writes: full (SQLite's
    SQLITE_FULL, "database or disk is full"; PostgreSQL's ``disk_full``, SQLSTATE 53100,
    "could not extend file"; an ``OSError`` ENOSPC/EFBIG) or failing to write (SQLite's
    SQLITE_IOERR_WRITE, "disk I/O error", which is also what a file-size limit gives it).
    Not "unreachable": the database answers, and retrying the same write will not help
    until space is freed."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EFBIG)
    if isinstance(error, sa.exc.DBAPIError):
        orig = error.orig
        if getattr(orig, "sqlite_errorname", None) in _SQLITE_STORAGE_ERRORS:
            return True
        if getattr(orig, "pgcode", None) == _DISK_FULL_SQLSTATE or getattr(orig, "sqlstate", None) == _DISK_FULL_SQLSTATE:
            return True
        text = str(orig).lower()
        return any(t in text for t in _DISK_FULL_TEXT)
    return False


def is_unreachable(error: BaseException) -> bool:
    """True when `error` means the database cannot be reached now (refused or lost
    connection, pool timeout, SQLite busy), not that a statement is wrong, nor that
    its storage is full (:func:`is_disk_full`)."""
    if is_disk_full(error):
        return False
    if isinstance(error, (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)):
        return True
    return isinstance(error, sa.exc.DBAPIError) and bool(error.connection_invalidated)


ADDED_COLUMNS = (("tenants", "service_tiers"), ("api_keys", "service_tiers"), ("requests", "service_tier"),
                 ("requests", "gateway_instance"), ("tenants", "max_file_bytes"), ("tenants", "max_files"),
                 ("tenants", "max_batches"), ("files", "expires_at"),
                 ("batches", "output_expires_after_s"))
"""(table, column): nullable columns added after their table first shipped (what an older
database lacks; :func:`add_missing_columns` adds any nullable column missing, these included)."""


def add_missing_columns(engine: sa.Engine) -> list[str]:
    """Adds the nullable columns of our tables that an existing database lacks (``ALTER TABLE
    ... ADD COLUMN``, NULL in existing rows; their indexes too). Returns "table.column" of each
    one added."""
    inspector = sa.inspect(engine)
    # IF NOT EXISTS (PostgreSQL): two gateways starting at once on one database.
    guard = "IF NOT EXISTS " if engine.dialect.name == "postgresql" else ""
    added = []
    with engine.begin() as conn:
        for table in metadata.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in have or not column.nullable:
                    continue
                kind = column.type.compile(dialect=engine.dialect)
                conn.execute(sa.text(f'ALTER TABLE {table.name} ADD COLUMN {guard}"{column.name}" {kind}'))
                added.append(f"{table.name}.{column.name}")
                for index in table.indexes:
                    if column.name in index.columns:
                        index.create(conn, checkfirst=True)
    return added


def open_database(url: str | None = None) -> sa.Engine:
    """A SQLAlchemy engine for `url` (default: :func:`default_database_url`), tables created.

    Raises:
      sqlalchemy.exc.ArgumentError: an unparsable URL.
      sqlalchemy.exc.OperationalError: the database cannot be reached or opened.
    """
    url = url or default_database_url()
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 10})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    else:
        # A database host that stops answering fails a connection in seconds, not minutes:
        # the ledger then spools (ledger.py) and the keys answer from memory (auth.py).
        connect_args = {"connect_timeout": 5} if url.startswith("postgresql") else {}
        engine = sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    metadata.create_all(engine)
    add_missing_columns(engine)
    return engine

