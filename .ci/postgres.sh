#!/usr/bin/env bash
# Starts a throwaway PostgreSQL for the ledger tests and exports XLASERVE_TEST_DATABASE_URL.
# Sourced by .ci/run; installs Debian's package if it is missing. Stopped by pg_stop on exit.
set -euo pipefail

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
fi
PG_BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
PG_DIR=$(mktemp -d /tmp/xlaserve-pg.XXXXXX)
PG_PORT=${PG_PORT:-54329}
PG_USER=postgres
chown "$PG_USER" "$PG_DIR"
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u "$PG_USER" -- "$@"; else "$@"; fi; }
as_pg "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres --auth=trust >/dev/null
as_pg "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w \
  -o "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
as_pg "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres xlaserve_test
pg_stop() { as_pg "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m fast stop >/dev/null 2>&1 || true; rm -rf "$PG_DIR"; }
export XLASERVE_TEST_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:$PG_PORT/xlaserve_test"
echo "PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') for the ledger tests at $XLASERVE_TEST_DATABASE_URL"
