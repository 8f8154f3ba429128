"""A throwaway PostgreSQL cluster that a test (or a benchmark) may stop and start again,
as ``.ci/postgres.sh`` starts one: Debian's ``initdb`` / ``pg_ctl`` on loopback, run as
the ``postgres`` user when we are root. Skips the test when PostgreSQL is not installed."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(found[-1]).parent if found else None


class PostgresCluster:
    """A cluster in a temporary directory on a free loopback port.

    Attributes:
      url: its SQLAlchemy URL (``postgresql+psycopg://postgres@127.0.0.1:PORT/xlaserve``).

    Raises:
      RuntimeError: PostgreSQL is not installed, or a command failed (with its output).
    """

    def __init__(self) -> None:
        self.bin = postgres_bin()
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.dir = Path(tempfile.mkdtemp(prefix="xlaserve-pg-"))
        self.port = _free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/xlaserve"
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        self._run("initdb", "-D", str(self.dir / "data"), "-U", "postgres", "--auth=trust")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "xlaserve")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout}{res.stderr}")

    def start(self) -> None:
        """Starts the server; returns once it accepts connections."""
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        """Stops the server (fast: open connections are cut); returns once it is down."""
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        """Stops the server if it runs and deletes the cluster."""
        try:
            self.stop()
        except RuntimeError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def worker_database_url(url: str, worker: str) -> str:
    """A database of its own for one pytest-xdist worker, in the cluster ``url`` names.

    ``url``: a SQLAlchemy URL of a scratch PostgreSQL database (``XLASERVE_TEST_DATABASE_URL``);
    ``worker``: the worker's id (``PYTEST_XDIST_WORKER``, e.g. ``gw0``). Creates (anew, dropping
    an older one of the same name) the database ``<name>_<worker>`` and returns its URL, so two
    workers never drop each other's tables.

    Raises:
      psycopg.OperationalError: the cluster cannot be reached.
    """
    import psycopg
    from sqlalchemy.engine import make_url

    base = make_url(url)
    name = f"{base.database}_{worker}"
    admin = base.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return base.set(database=name).render_as_string(hide_password=False)
