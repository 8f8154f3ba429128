"""Ledger rows for the console's tests: a known mix of tenants, models, statuses and timings,
written through the ledger's own writer, and the sums the console must show for them."""

from __future__ import annotations

from serving.gateway.accounts.ledger import Ledger

MODELS = ("tiny-random", "tiny-random:adapter")
TENANTS = ("acme", "globex", "initech")


def fill_ledger(ledger: Ledger, now: float, n: int = 30, spacing_s: float = 50.0) -> list[dict]:
    """Writes `n` completed rows, the i-th created ``5 + i * spacing_s`` seconds before `now`
    (so within the last hour for the defaults), and returns them as written."""
    rows = []
    for i in range(n):
        created = now - 5 - i * spacing_s
        status = "error" if i % 7 == 3 else "ok"
        ttft = 0.010 + 0.001 * i
        row = {"request_id": f"chatcmpl-fill{i:04d}", "x_request_id": f"fill-{i:04d}",
               "tenant": TENANTS[i % 3], "key_id": f"key_fill{i % 2}", "model": MODELS[i % 2],
               "priority": "normal", "stream": bool(i % 2), "status": "running", "created_at": created,
               "service_tier": "default" if i % 4 else "flex",
               "trace": {"events": [{"t": created, "event": "admitted", "reserved_tokens": 40},
                                    {"t": created + 0.002, "event": "engine_admitted"},
                                    {"t": created + ttft, "event": "first_token"},
                                    {"t": created + ttft + 0.05, "event": "finished", "status": status,
                                     "finish_reason": "length"}],
                         "replica": f"http://replica-{i % 2}:9000", "region": "eu-west",
                         "replica_retries": [{"replica": "http://replica-9:9000", "region": "us-east",
                                              "reason": "overloaded", "error": "queue full"}] if i == 2 else []}}
        done = {"status": status, "finish_reason": "length" if status == "ok" else None,
                "error": "engine failed" if status == "error" else None,
                "first_token_at": created + ttft, "finished_at": created + ttft + 0.05,
                "prompt_tokens": 10 + i, "cached_tokens": i % 5, "completion_tokens": 3 * i + 1,
                "queue_time_s": 0.002, "ttft_s": ttft, "itl_mean_s": 0.005 + 0.0001 * i, "itl_max_s": 0.02,
                "e2e_s": ttft + 0.05, "cost_usd": round(1e-6 * (i + 1), 9)}
        ledger.open_row(row)
        ledger.close_row(row["request_id"], done)
        rows.append({**row, **done})
    ledger.flush()
    return rows


def sums(rows: list[dict]) -> dict:
    """What the overview's totals must show for `rows`."""
    return {"requests": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "cost_usd": sum(r["cost_usd"] for r in rows),
            "errors": sum(r["status"] == "error" for r in rows)}
