"""``xlaserve keys``, ``xlaserve tenants`` and ``xlaserve usage``: the gateway's database from the shell.

    xlaserve keys create --tenant acme --rpm 60 --tpm 100000 --max-concurrent 8
    xlaserve keys create --tenant acme --service-tiers default,flex
    xlaserve keys list [--tenant acme]
    xlaserve keys revoke key_0123456789ab
    xlaserve tenants set acme --rpm 600 --models gemma-3-270m --service-tiers default,flex,priority
    xlaserve tenants set acme --max-file-bytes 100000000 --max-files 100 --max-batches 10
    xlaserve tenants list
    xlaserve usage --group-by day --start 2026-11-01 [--tenant acme]

They use the same database as ``xlaserve serve`` (``--database-url``, else
``$XLASERVE_DATABASE_URL``, else SQLite under ``$XLASERVE_DATA_DIR``), and may
run while it serves.
"""

from __future__ import annotations

import argparse
import datetime
import sys


def _limits(args):
    from serving.gateway.accounts.api_keys import Limits

    return Limits(rpm=args.rpm, tpm=args.tpm, max_concurrent=args.max_concurrent)


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpm", type=int, help="requests per minute (default: unlimited)")
    p.add_argument("--tpm", type=int, help="tokens per minute: prompt + max_tokens reserved, "
                   "settled to prompt + completion tokens (default: unlimited)")
    p.add_argument("--max-concurrent", type=int, help="requests in flight at once (default: unlimited)")
    p.add_argument("--service-tiers", help="comma-separated service tiers its requests may ask for: "
                   "default, flex, priority (default: all)")


def _tiers(args):
    return None if args.service_tiers is None else [t.strip() for t in args.service_tiers.split(",") if t.strip()]


def _store(args):
    from serving.gateway.accounts.api_keys import KeyStore
    from serving.gateway.accounts.database import open_database

    return KeyStore(open_database(args.database_url))


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _print_table(header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_keys(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.keys_command == "create":
        key, info = store.create_key(args.tenant, name=args.name, limits=_limits(args), is_admin=args.admin,
                                     service_tiers=_tiers(args))
        print(key)
        print(f"key id {info.key_id}, tenant {info.tenant}{' (admin)' if info.is_admin else ''}. "
              "Store the key now: it is not shown again.", file=sys.stderr)
    elif args.keys_command == "list":
        rows = [[k.key_id, k.tenant, k.name, k.key_prefix + "…", "yes" if k.is_admin else "",
                 k.limits.rpm, k.limits.tpm, k.limits.max_concurrent, _fmt_time(k.created_at),
                 _fmt_time(k.revoked_at) if k.revoked_at else ""]
                for k in store.list_keys(args.tenant)]
        _print_table(["KEY_ID", "TENANT", "NAME", "PREFIX", "ADMIN", "RPM", "TPM", "CONCURRENT",
                      "CREATED", "REVOKED"], rows)
    elif args.keys_command == "revoke":
        if not store.revoke(args.key_id):
            print(f"xlaserve: error: no active key {args.key_id!r}", file=sys.stderr)
            return 1
        print(f"revoked {args.key_id}")
    return 0


def cmd_tenants(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.tenants_command == "set":
        models = None if args.models is None else [m for m in args.models.split(",") if m]
        from serving.gateway.accounts.api_keys import Quotas

        quotas = Quotas(file_bytes=args.max_file_bytes, files=args.max_files, batches=args.max_batches)
        store.set_tenant(args.tenant, _limits(args), models, _tiers(args), quotas=quotas)
        print(f"tenant {args.tenant} set")
    else:
        rows = [[t["name"], t["rpm"], t["tpm"], t["max_concurrent"], t["models"] or "all",
                 t["service_tiers"] or "all", t["max_file_bytes"], t["max_files"], t["max_batches"]]
                for t in store.list_tenants()]
        _print_table(["TENANT", "RPM", "TPM", "CONCURRENT", "MODELS", "SERVICE_TIERS", "FILE_BYTES", "FILES",
                      "BATCHES"], rows)
    return 0


def _parse_when(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        dt = datetime.datetime.fromisoformat(value)
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=datetime.timezone.utc)
        return dt.timestamp()


def usage_table_rows(rows: list[dict]) -> list[list[object]]:
    """Rows of the usage table (also what ``GET /v1/usage`` sums)."""
    return [[r["group"], r["requests"], r["incomplete"], r["errors"], r["prompt_tokens"],
             r["cached_tokens"], r["completion_tokens"], f"{r['cost_usd']:.6f}"] for r in rows]


def cmd_usage(args: argparse.Namespace) -> int:
    from serving.gateway.accounts.database import open_database
    from serving.gateway.accounts.ledger import Ledger

    ledger = Ledger(open_database(args.database_url))
    try:
        rows = ledger.usage(_parse_when(args.start), _parse_when(args.end), args.group_by, args.tenant)
    finally:
        ledger.close()
    table = usage_table_rows(rows)
    if rows:
        table.append(["TOTAL"] + [sum(r[k] for r in rows) for k in (
            "requests", "incomplete", "errors", "prompt_tokens", "cached_tokens", "completion_tokens")]
            + [f"{sum(r['cost_usd'] for r in rows):.6f}"])
    _print_table([args.group_by.upper(), "REQUESTS", "INCOMPLETE", "ERRORS", "PROMPT_TOKENS",
                  "CACHED_TOKENS", "COMPLETION_TOKENS", "COST_USD"], table)
    return 0


def register(sub) -> None:
    """Registers ``keys``, ``tenants`` and ``usage`` on the ``xlaserve`` parser's subparsers."""
    from serving.gateway.accounts.ledger import GROUP_BY

    def db_flag(p):
        p.add_argument("--database-url", help="SQLAlchemy URL (default: $XLASERVE_DATABASE_URL, "
                       "else SQLite under $XLASERVE_DATA_DIR)")

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    create = ksub.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", help="a label for the key")
    create.add_argument("--admin", action="store_true", help="may read every tenant's usage and traces")
    _add_limit_flags(create)
    lst = ksub.add_parser("list", help="list keys (never their secrets)")
    lst.add_argument("--tenant")
    revoke = ksub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    for p in (create, lst, revoke):
        db_flag(p)
    keys.set_defaults(func=cmd_keys)

    tenants = sub.add_parser("tenants", help="set tenants' shared limits and model allow-lists")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True)
    tset = tsub.add_parser("set", help="create or replace a tenant's limits")
    tset.add_argument("tenant")
    _add_limit_flags(tset)
    tset.add_argument("--models", help="comma-separated models the tenant may use (default: all)")
    tset.add_argument("--max-file-bytes", type=int, help="bytes of files it may store, uploads and batch "
                      "outputs together (default: unlimited)")
    tset.add_argument("--max-files", type=int, help="files it may store at once (default: unlimited)")
    tset.add_argument("--max-batches", type=int, help="unfinished batches it may have (default: unlimited)")
    tlist = tsub.add_parser("list", help="list tenants with their limits and models")
    for p in (tset, tlist):
        db_flag(p)
    tenants.set_defaults(func=cmd_tenants)

    usage = sub.add_parser("usage", help="print usage from the ledger")
    usage.add_argument("--start", help="Unix seconds or ISO date (inclusive)")
    usage.add_argument("--end", help="Unix seconds or ISO date (exclusive)")
    usage.add_argument("--group-by", default="model", choices=GROUP_BY)
    usage.add_argument("--tenant", help="only this tenant (default: all)")
    db_flag(usage)
    usage.set_defaults(func=cmd_usage)
