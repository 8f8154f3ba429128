"""Prometheus metrics of the gateway and its engines (prometheus-client).

Names follow vLLM's where one exists, with the ``xlaserve:`` prefix:

  histograms  xlaserve:time_to_first_token_seconds, xlaserve:inter_token_latency_seconds,
              xlaserve:e2e_request_latency_seconds, xlaserve:request_queue_time_seconds
  counters    xlaserve:requests_total{status}, xlaserve:request_success_total{finish_reason},
              xlaserve:prompt_tokens_total, xlaserve:generation_tokens_total,
              xlaserve:cached_prompt_tokens_total, xlaserve:request_cost_usd_total,
              xlaserve:rate_limit_rejections_total{scope,limit},
              xlaserve:prefix_cache_queries_total, xlaserve:prefix_cache_hits_total (tokens),
              xlaserve:spec_decode_num_drafts_total, xlaserve:spec_decode_num_draft_tokens_total,
              xlaserve:spec_decode_num_accepted_tokens_total (speculative decoding, as vLLM's),
              xlaserve:spec_decode_num_draft_tokens_per_pos_total{position},
              xlaserve:spec_decode_num_accepted_tokens_per_pos_total{position} (per draft position),
              xlaserve:host_kv_cache_hits_total, xlaserve:host_kv_cache_stores_total,
              xlaserve:host_kv_cache_evictions_total (host KV tier, in pages),
              xlaserve:disk_kv_cache_hits_total, xlaserve:disk_kv_cache_stores_total,
              xlaserve:disk_kv_cache_evictions_total, xlaserve:disk_kv_cache_dropped_pages_total
              (disk KV tier, in pages; dropped: the disk full), xlaserve:disk_kv_cache_read_bytes_total,
              xlaserve:disk_kv_cache_written_bytes_total, xlaserve:disk_kv_cache_ignored_files_total{why}
              (corrupt | foreign),
              xlaserve:engine_turn_seconds_total{part}, xlaserve:engine_turns_total{kind},
              xlaserve:engine_step_tokens_total{kind} (where the engine loop's time goes:
              serving.runtime.turn_profile; in-process engines only)
  gauges      xlaserve:num_requests_running, xlaserve:num_requests_waiting,
              xlaserve:kv_cache_usage_perc (0..1), xlaserve:prefix_cache_hit_rate (0..1),
              xlaserve:spec_decode_acceptance_rate (0..1), xlaserve:spec_decode_tokens_per_step,
              xlaserve:spec_decode_num_speculative_tokens (the K of the present load; 0: off),
              xlaserve:host_kv_cache_usage_bytes, xlaserve:host_kv_cache_capacity_bytes,
              xlaserve:disk_kv_cache_usage_bytes, xlaserve:disk_kv_cache_capacity_bytes
  summary     xlaserve:disk_kv_cache_read_seconds (_count: pages read from disk, _sum: seconds)
  info        xlaserve:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}
              (the Kubernetes inference gateway's LoRA metric, vLLM's labels: the adapters of
              running and of waiting requests, comma-separated; the value is the scrape's Unix
              time; one series per engine serving LoRA adapters, no model_name label)
  ledger      xlaserve:ledger_spool_records, xlaserve:ledger_spool_bytes (gauges: usage-row
              writes waiting in the spool for the database), xlaserve:ledger_spool_replayed_total,
              xlaserve:ledger_spool_quarantined_total (corrupt spool lines moved aside),
              xlaserve:ledger_unavailable_rejections_total (503s while the spool is full);
              no model_name label

Every series but the ledger's has a ``model_name`` label. Gateway counters are updated when a
request's ledger row is completed, from the same numbers, so they agree with
the ledger; engine gauges are read from ``EngineClient.stats()`` at scrape time.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

# Buckets as vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Reads each engine's ``stats()`` at scrape time.

    Args:
      engines: model name -> a callable returning the engine's stats (an
        object with num_running, num_waiting, kv_cache_usage,
        prefix_cache_queries, prefix_cache_hits), or None when it has none.
    """

    def __init__(self, engines: Callable[[], Mapping[str, Callable[[], object] | None]]) -> None:
        self.engines = engines

    def collect(self) -> Iterable:
        running = GaugeMetricFamily("xlaserve:num_requests_running",
                                    "Requests in the engine's running batch.", labels=["model_name"])
        waiting = GaugeMetricFamily("xlaserve:num_requests_waiting",
                                    "Requests waiting for admission.", labels=["model_name"])
        kv = GaugeMetricFamily("xlaserve:kv_cache_usage_perc",
                               "Fraction of KV-cache pages in use (0..1).", labels=["model_name"])
        hit_rate = GaugeMetricFamily("xlaserve:prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens "
                                     "looked up, over the engine's life.", labels=["model_name"])
        queries = CounterMetricFamily("xlaserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", labels=["model_name"])
        hits = CounterMetricFamily("xlaserve:prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache.", labels=["model_name"])
        drafts = CounterMetricFamily("xlaserve:spec_decode_num_drafts",
                                     "Speculative decoding: verified rows that had draft tokens.",
                                     labels=["model_name"])
        draft_tokens = CounterMetricFamily("xlaserve:spec_decode_num_draft_tokens",
                                           "Speculative decoding: draft tokens verified.", labels=["model_name"])
        accepted = CounterMetricFamily("xlaserve:spec_decode_num_accepted_tokens",
                                       "Speculative decoding: draft tokens accepted.", labels=["model_name"])
        acceptance = GaugeMetricFamily("xlaserve:spec_decode_acceptance_rate",
                                       "Accepted / verified draft tokens, over the engine's life.",
                                       labels=["model_name"])
        per_step = GaugeMetricFamily("xlaserve:spec_decode_tokens_per_step",
                                     "Tokens a speculating request gets per step (1 + accepted / "
                                     "verified rows), over the engine's life.", labels=["model_name"])
        drafted_pos = CounterMetricFamily("xlaserve:spec_decode_num_draft_tokens_per_pos",
                                          "Speculative decoding: rows that verified a draft at this "
                                          "position (0: a row's first draft).", labels=["model_name", "position"])
        accepted_pos = CounterMetricFamily("xlaserve:spec_decode_num_accepted_tokens_per_pos",
                                           "Speculative decoding: rows that accepted their draft at this "
                                           "position.", labels=["model_name", "position"])
        k_now = GaugeMetricFamily("xlaserve:spec_decode_num_speculative_tokens",
                                  "Speculative decoding: the most drafts a request gets a step at the present "
                                  "load (K shrinking within --speculative-token-budget as more requests run; 0 "
                                  "above --speculative-max-batch or once the budget leaves no draft).",
                                  labels=["model_name"])
        host = {  # the host KV tier (serving.core.kv.host_kv_cache): EngineStats field -> family
            "host_kv_hits": CounterMetricFamily("xlaserve:host_kv_cache_hits",
                                                "Host KV tier: pages reloaded instead of recomputed.",
                                                labels=["model_name"]),
            "host_kv_stores": CounterMetricFamily("xlaserve:host_kv_cache_stores",
                                                  "Host KV tier: evicted device pages copied in.",
                                                  labels=["model_name"]),
            "host_kv_evictions": CounterMetricFamily("xlaserve:host_kv_cache_evictions",
                                                     "Host KV tier: pages dropped to make room.",
                                                     labels=["model_name"]),
            "host_kv_usage_bytes": GaugeMetricFamily("xlaserve:host_kv_cache_usage_bytes",
                                                     "Host KV tier: bytes of pages held.", labels=["model_name"]),
            "host_kv_capacity_bytes": GaugeMetricFamily("xlaserve:host_kv_cache_capacity_bytes",
                                                        "Host KV tier: its bound in bytes (0: off).",
                                                        labels=["model_name"]),
        }
        for field, metric, what in (  # the disk KV tier (serving.core.kv.disk_kv_store)
                ("disk_kv_hits", "hits", "pages read back instead of recomputed"),
                ("disk_kv_stores", "stores", "pages written"),
                ("disk_kv_evictions", "evictions", "page files removed to keep within its bound"),
                ("disk_kv_dropped_pages", "dropped_pages", "pages not written (the disk full)"),
                ("disk_kv_bytes_read", "read_bytes", "file bytes read"),
                ("disk_kv_bytes_written", "written_bytes", "file bytes written")):
            host[field] = CounterMetricFamily(f"xlaserve:disk_kv_cache_{metric}", f"Disk KV tier: {what}.",
                                              labels=["model_name"])
        host["disk_kv_usage_bytes"] = GaugeMetricFamily("xlaserve:disk_kv_cache_usage_bytes",
                                                        "Disk KV tier: bytes of page files.", labels=["model_name"])
        host["disk_kv_capacity_bytes"] = GaugeMetricFamily("xlaserve:disk_kv_cache_capacity_bytes",
                                                           "Disk KV tier: its bound in bytes (0: off).",
                                                           labels=["model_name"])
        disk_ignored = CounterMetricFamily("xlaserve:disk_kv_cache_ignored_files", "Disk KV tier: page files "
                                           "ignored (corrupt: torn or failing its checksum, removed; foreign: "
                                           "another model's or KV format's).", labels=["model_name", "why"])
        disk_read = SummaryMetricFamily("xlaserve:disk_kv_cache_read_seconds",
                                        "Disk KV tier: seconds reading pages (a page file opened, read, "
                                        "checked), off the engine loop.", labels=["model_name"])
        turn_seconds = CounterMetricFamily("xlaserve:engine_turn_seconds",
                                           "Engine loop: seconds of its turns by part (plan, dispatch_prefill, "
                                           "dispatch_decode, readback_wait, readback_host, other).",
                                           labels=["model_name", "part"])
        turns = CounterMetricFamily("xlaserve:engine_turns", "Engine loop: turns by what they dispatched "
                                    "(mixed, prefill, decode, other).", labels=["model_name", "kind"])
        step_tokens = CounterMetricFamily("xlaserve:engine_step_tokens", "Engine loop: prefill tokens and "
                                          "decode rows its turns dispatched.", labels=["model_name", "kind"])
        lora_info = GaugeMetricFamily("xlaserve:lora_requests_info",
                                      "LoRA adapters of running and waiting requests and the device's adapter "
                                      "slots (the value: the scrape's Unix time).",
                                      labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        engines_seen: set[int] = set()  # a LoRA adapter's name reads its base engine's stats
        for name, stats_fn in self.engines().items():
            if stats_fn is None:
                continue
            s = stats_fn()
            engine = id(getattr(stats_fn, "__self__", stats_fn))
            if getattr(s, "max_loras", 0) > 0 and engine not in engines_seen:
                lora_info.add_metric([str(s.max_loras), ",".join(s.lora_running), ",".join(s.lora_waiting)],
                                     time.time())
            engines_seen.add(engine)
            for key, value in (getattr(s, "turn_profile", None) or {}).items():
                group, _, label = key.partition(".")
                if group == "seconds":
                    turn_seconds.add_metric([name, label], value)
                elif group == "turns":
                    turns.add_metric([name, label], value)
                else:
                    step_tokens.add_metric([name, "prefill" if key == "prefill_tokens" else "decode"], value)
            for field, family in host.items():
                family.add_metric([name], getattr(s, field, 0))
            if getattr(s, "disk_kv_capacity_bytes", 0):
                disk_ignored.add_metric([name, "corrupt"], s.disk_kv_corrupt_files)
                disk_ignored.add_metric([name, "foreign"], s.disk_kv_foreign_files)
                disk_read.add_metric([name], count_value=s.disk_kv_reads, sum_value=s.disk_kv_read_seconds)
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            kv.add_metric([name], s.kv_cache_usage)
            hit_rate.add_metric([name], s.prefix_cache_hits / s.prefix_cache_queries
                                if s.prefix_cache_queries else 0.0)
            queries.add_metric([name], s.prefix_cache_queries)
            hits.add_metric([name], s.prefix_cache_hits)
            rows, proposed, ok = (getattr(s, "spec_verify_rows", 0), getattr(s, "spec_draft_tokens", 0),
                                  getattr(s, "spec_accepted_tokens", 0))
            drafts.add_metric([name], rows)
            draft_tokens.add_metric([name], proposed)
            accepted.add_metric([name], ok)
            acceptance.add_metric([name], ok / proposed if proposed else 0.0)
            per_step.add_metric([name], 1 + ok / rows if rows else 0.0)
            for j, n in enumerate(getattr(s, "spec_drafted_per_position", ())):
                drafted_pos.add_metric([name, str(j)], n)
            for j, n in enumerate(getattr(s, "spec_accepted_per_position", ())):
                accepted_pos.add_metric([name, str(j)], n)
            k_now.add_metric([name], getattr(s, "spec_num_tokens_now", 0))
        return [running, waiting, kv, hit_rate, queries, hits, drafts, draft_tokens, accepted, acceptance,
                per_step, drafted_pos, accepted_pos, k_now, *host.values(), disk_ignored, disk_read, turn_seconds,
                turns, step_tokens, lora_info]


class _ReplayedCollector(Collector):
    """``xlaserve:ledger_spool_replayed_total``, read from the ledger at scrape time."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterable:
        yield CounterMetricFamily("xlaserve:ledger_spool_replayed",
                                  "Spooled usage-row writes replayed into the database.",
                                  value=self.ledger.replayed_total)
        spool = getattr(self.ledger, "spool", None)
        yield CounterMetricFamily("xlaserve:ledger_spool_quarantined",
                                  "Corrupt spool lines moved to the quarantine file and skipped.",
                                  value=0 if spool is None else spool.quarantined)
        yield CounterMetricFamily("xlaserve:ledger_database_full_writes",
                                  "Row writes the ledger database refused because its storage is full "
                                  "(spooled instead).", value=getattr(self.ledger, "database_full_writes", 0))


class GatewayMetrics:
    """The gateway's metrics in their own registry (one per app, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("xlaserve:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              ["model_name"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("xlaserve:inter_token_latency_seconds",
                             "Time between consecutive generated tokens.",
                             ["model_name"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("xlaserve:e2e_request_latency_seconds",
                             "Time from arrival to the end of the request.",
                             ["model_name"], buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("xlaserve:request_queue_time_seconds",
                                    "Time a request waited before its first prefill step.",
                                    ["model_name"], buckets=_REQUEST_BUCKETS, registry=r)
        self.requests = Counter("xlaserve:requests", "Requests by final status "
                                "(ok, error, cancelled, rate_limited, shed).",
                                ["model_name", "status"], registry=r)
        self.success = Counter("xlaserve:request_success", "Finished requests by finish_reason.",
                               ["model_name", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("xlaserve:prompt_tokens", "Prompt tokens of metered requests.",
                                     ["model_name"], registry=r)
        self.cached_tokens = Counter("xlaserve:cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache.",
                                     ["model_name"], registry=r)
        self.generation_tokens = Counter("xlaserve:generation_tokens", "Generated tokens.",
                                         ["model_name"], registry=r)
        self.cost = Counter("xlaserve:request_cost_usd", "Cost of metered requests in USD.",
                            ["model_name"], registry=r)
        self.rate_limited = Counter("xlaserve:rate_limit_rejections",
                                    "Requests rejected by a rate limit.",
                                    ["model_name", "scope", "limit"], registry=r)

        self.ledger_unavailable = Counter("xlaserve:ledger_unavailable_rejections",
                                          "Requests refused with 503 because the ledger's spool was "
                                          "full or could not be written.", registry=r)

    def watch_ledger(self, ledger) -> None:
        """Adds the spool gauges of `ledger` (a ``Ledger``), read at scrape time."""
        Gauge("xlaserve:ledger_spool_records", "Usage-row writes in the spool, waiting for the "
              "ledger database.", registry=self.registry).set_function(lambda: ledger.spooled_records)
        Gauge("xlaserve:ledger_spool_bytes", "Bytes of those writes.",
              registry=self.registry).set_function(lambda: ledger.spooled_bytes)
        Gauge("xlaserve:ledger_database_full", "1 while the ledger database refuses writes because its "
              "storage is full (they go to the spool), not unreachable.",
              registry=self.registry).set_function(lambda: float(ledger.database_full))
        spool = ledger.spool
        if spool is not None:
            Gauge("xlaserve:ledger_spool_free_bytes", "Free bytes on the ledger spool's filesystem.",
                  registry=self.registry).set_function(lambda: spool.free_bytes)
            Gauge("xlaserve:ledger_spool_shares_database_filesystem", "1 when the spool is on the SQLite "
                  "database's filesystem (they fill together).",
                  registry=self.registry).set_function(lambda: float(spool.shares_database_filesystem))
        self.registry.register(_ReplayedCollector(ledger))

    def add_engine_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def observe_request(self, model: str, status: str, finish_reason: str | None,
                        prompt_tokens: int, cached_tokens: int, completion_tokens: int, cost: float,
                        queue_time: float | None, ttft: float | None, itls: Iterable[float],
                        e2e: float | None) -> None:
        """Records one finished (metered) request."""
        self.requests.labels(model, status).inc()
        if finish_reason is not None and status == "ok":
            self.success.labels(model, finish_reason).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.cached_tokens.labels(model).inc(cached_tokens)
        self.generation_tokens.labels(model).inc(completion_tokens)
        self.cost.labels(model).inc(cost)
        if queue_time is not None:
            self.queue_time.labels(model).observe(queue_time)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        h = self.itl.labels(model)
        for x in itls:
            h.observe(x)
        if e2e is not None:
            self.e2e.labels(model).observe(e2e)
