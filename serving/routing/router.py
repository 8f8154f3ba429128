"""The router: which engine replica serves a request, behind one ``EngineClient``.

:class:`Router` drives several remote replicas
(``serving.rpc.remote_engine.RemoteEngine``) and is itself an
``EngineClient``, so the gateway serves through it exactly as through an
in-process engine. Policies (``--router``):

- ``kv-aware`` (default), after NVIDIA Dynamo's KV router: each replica's cost is
  ``prefill_weight * (prompt pages it would have to compute) + (its load in pages)``;
  the pages it would not compute are the request's leading prompt pages found
  in the replica's cached page hashes (its KV events) or in the prompts of
  requests in flight there (computed soon: SGLang's router inserts a prompt
  into its tree as it routes it), hashed with the request's prefix-cache salt
  (the tenant scope, ``cache_scope.py``) exactly as the engine's prefix cache
  hashes them; its load is the larger of the pages this gateway's requests in
  flight there add (uncached prompt pages and their completions) and the
  prompt pages waiting there (``GetLoad``, other gateways' requests
  included). The lowest cost wins. A prompt page the replica holds in its host
  KV tier (``serving.core.kv.host_kv_cache``; its KV events name the tier) right after
  its device hit is reloaded rather than computed: it saves ``host_page_weight``
  (0.25) of what a device page saves.
- ``least-load``: the fewest requests (the larger of the replica's running +
  waiting and this gateway's in-flight count).
- ``round-robin``: the next replica that is up.

Imbalance guard (SGLang's cache-aware router): when the most and least loaded
replicas differ by more than ``balance_abs`` requests *and* the most loaded
carries more than ``balance_rel`` times the least, kv-aware routing gives way
to least-load, so a hot prefix spills to other replicas instead of piling
onto the one that caches it (llm-d reports ~55% request success for
prefix-only scoring under such load).

The choices of one prompt (``parent_id``) go where their parent went. A
replica that is down is skipped; a request whose replica fails before its
first event, or refuses it as overloaded, is sent to the next one (all
overloaded: the gateway's 503); a request it was running ends with an
"error" event. Decisions are counted by replica and reason (``cache_hit``,
``host_cache_hit`` (only host-tier pages matched), ``load``, ``imbalance``, ``least_load``, ``round_robin``, ``parent``,
``retry``), and each event carries the URL of the replica that served it
(``TokenEvent.replica``, the trace's ``replica``).

Regions: a router given its gateway's ``region`` sends requests to the up
replicas whose ``region`` label (``xlaserve engine --labels region=R``) is
that region, by the policy above, and crosses to the others only when no
replica of its region is up (reason ``cross_region_down``) or every one of them
is overloaded while some other is not (``cross_region_overloaded``). A replica
is *overloaded* when it holds ``overload_per_slot`` (2.0) times its slots in
requests (``requests_on``: its running + waiting, or this gateway's in flight
there, whichever is more), or when its KV cache is ``overload_kv`` (95%) full
with requests waiting. A retry that crosses regions counts the crossing's
reason rather than ``retry``; every hop a request took away from a replica is
on its events (``TokenEvent.replica_retries``, the trace's ``replica_retries``)
with the region of the replica that served it (``TokenEvent.region``).
Without a region, or with replicas that have no labels, nothing changes.

Disaggregated serving: with up replicas of role ``prefill`` and ``decode``,
each request's prompt goes to a prefill replica (by the policy above, among
them) and its decoding to the least-loaded decode replica, the KV pages moving
between them (``serving.routing.disaggregation``); replicas of role ``both``
serve requests whole otherwise. Decisions then have the reasons
``prefill_<reason>`` and ``decode``; the transfers' bytes and seconds are
metrics.

Neither the hashes nor the decisions cross tenants: a tenant's prompt pages
hash with its own salt, so another tenant's requests never match them.

LoRA adapters: each replica reports the adapters it serves with the digest of their
weights and config (``RemoteEngine.loras``, from every ``GetLoad``). A request naming an
adapter (``EngineRequest.lora_name``) goes only to replicas serving it, whole (KV transfer
carries no adapter requests); none does: ``RequestRejectedError``. Its page hashes are
salted as the replica's engine salts them (``lora_salt`` with the digest that replica
reports), so a base-model prefix cached on one replica does not attract it, and requests
of one adapter with one prompt go where that adapter's pages are.
:meth:`Router.load_lora` and :meth:`Router.unload_lora` send the gateway's load and unload
to every replica (up) that takes adapters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
from typing import AsyncIterator, Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    EngineStats,
    LoraInUseError,
    ReplicaRetry,
    RequestRejectedError,
    TokenEvent,
)
from serving.core.kv.kv_cache_manager import lora_salt, prompt_page_hashes
from serving.routing import disaggregation
from serving.rpc.remote_engine import RemoteEngine, ReplicaUnavailable, info_mismatch

log = logging.getLogger("xlaserve.router")

POLICIES = ("kv-aware", "least-load", "round-robin")
HOST_PAGE_WEIGHT = 0.25
"""What a replica's host-tier page saves, against a device-cached page (kv-aware)."""
OVERLOAD_PER_SLOT = 2.0
"""A replica holding this many requests per slot (running + waiting) is overloaded (regions)."""
OVERLOAD_KV = 0.95
"""A replica whose KV cache is this full (0..1) while requests wait there is overloaded (regions)."""


@dataclasses.dataclass
class _InFlight:
    replica: RemoteEngine
    pages: int  # pages it adds there: prompt pages not cached + its completion's
    hashes: tuple[bytes, ...]  # its prompt's page hashes, pending there until it ends


class Router:
    """An ``EngineClient`` over engine replicas of one model.

    Args:
      replicas: the replicas (their ``info`` checked to serve one model with one tokenizer).
      policy: one of :data:`POLICIES`.
      prefill_weight: kv-aware: cost of one prompt page to compute, against one page of load.
        Above Dynamo's 1.0 by default: at 1.0 the second request of a burst sharing a
        prefix ties between waiting behind the first one's prefill and computing the
        prefix again elsewhere, and half such bursts scatter (tests/serving/routing/test_router.py).
      balance_abs, balance_rel: the imbalance guard's thresholds (requests; a ratio).
      host_page_weight: kv-aware: the part of a device hit's saving that a host-tier hit
        saves, per page (0..1; the page is reloaded, not recomputed, but not free).
      region: the gateway's own region: replicas labelled with it are preferred
        (None or "": no preference).
      overload_per_slot, overload_kv: when a replica counts as overloaded (:meth:`overloaded`).

    Raises:
      ValueError: no replicas, an unknown policy, or replicas that disagree on
        the model, its tokenizer or page size.
    """

    def __init__(self, replicas: Sequence[RemoteEngine], policy: str = "kv-aware",
                 prefill_weight: float = 2.0, balance_abs: int = 16, balance_rel: float = 1.5,
                 host_page_weight: float = HOST_PAGE_WEIGHT, region: str | None = None,
                 overload_per_slot: float = OVERLOAD_PER_SLOT, overload_kv: float = OVERLOAD_KV) -> None:
        if not replicas:
            raise ValueError("a router needs at least one engine replica")
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        for r in replicas[1:]:
            why = info_mismatch(r.info, replicas[0].info)
            if why is not None:
                raise ValueError(f"engine replicas {replicas[0].url} and {r.url} disagree: {why}")
        self.replicas = list(replicas)
        self.policy = policy
        self.prefill_weight = prefill_weight
        self.host_page_weight = host_page_weight
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.region = region or ""
        self.overload_per_slot = overload_per_slot
        self.overload_kv = overload_kv
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()
        self._inflight: dict[str, _InFlight] = {}
        # Per replica: page hashes of prompts routed there and still in flight, as if cached
        # (SGLang's router inserts a prompt into its tree when it routes it): the replica's
        # KV events report them only once computed, and a burst of one prefix would
        # otherwise scatter before its first request's events arrive.
        self._pending: dict[int, collections.Counter[bytes]] = {id(r): collections.Counter() for r in replicas}
        self._rr = itertools.count()
        self.transfers = disaggregation.TransferStats()

    # -- EngineClient ---------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return min(r.info.max_model_len for r in self.replicas)

    @property
    def kv_capacity_tokens(self) -> int:
        return min(r.info.kv_capacity_tokens for r in self.replicas)

    def is_ready(self) -> bool:
        """True while at least one replica is up."""
        return any(r.up for r in self.replicas)

    def stats(self) -> EngineStats:
        """The replicas' last reported loads, summed (those that are up)."""
        up = [r.load for r in self.replicas if r.up]
        total = sum(s.kv_pages_total for s in up)
        used = sum(s.kv_pages_used for s in up)
        return EngineStats(
            num_running=sum(s.num_running for s in up), num_waiting=sum(s.num_waiting for s in up),
            waiting_prompt_tokens=sum(s.waiting_prompt_tokens for s in up),
            kv_cache_usage=used / total if total else 0.0, kv_pages_used=used, kv_pages_total=total,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in up),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in up),
            num_preemptions=sum(s.num_preemptions for s in up))

    def submit(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """Routes the request; its events carry ``replica``. Admission errors (and
        :class:`EngineOverloadedError` when no replica is up) raise on the first iteration."""
        return self._stream(request)

    async def cancel(self, request_id: str) -> None:
        held = self._inflight.get(request_id)
        if held is not None:
            await held.replica.abort(request_id)

    # -- lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        """Opens every replica's channel and background tasks (on the serving event loop)."""
        for r in self.replicas:
            await r.open()

    async def close(self) -> None:
        for r in self.replicas:
            await r.close()

    async def wait_until_up(self, n: int = 1) -> None:
        """Returns once ``n`` replicas are up (for tests and start-up logs)."""
        while sum(r.up for r in self.replicas) < n:
            await asyncio.sleep(0.05)

    # -- routing ------------------------------------------------------------------------

    def requests_on(self, r: RemoteEngine) -> int:
        mine = sum(1 for f in self._inflight.values() if f.replica is r)
        return max(mine, r.load.num_running + r.load.num_waiting)

    def _pages_on(self, r: RemoteEngine) -> float:
        """The replica's load in KV pages: what this gateway's requests there add (their
        uncached prompt pages and completions), or the prompt pages waiting there (its last
        GetLoad, other gateways' included), whichever is more. Pages of cached prefixes
        shared by running requests are not load: taking one more request that shares them
        costs no memory."""
        mine = sum(f.pages for f in self._inflight.values() if f.replica is r)
        return max(mine, r.load.waiting_prompt_tokens / max(1, r.page_size))

    def overloaded(self, r: RemoteEngine) -> bool:
        """Whether ``r`` holds ``overload_per_slot`` times its slots in requests (:meth:`requests_on`),
        or its KV cache is ``overload_kv`` full while requests wait there (its last GetLoad)."""
        slots = max(1, r.info.max_slots)
        return (self.requests_on(r) >= self.overload_per_slot * slots
                or (r.load.num_waiting > 0 and r.load.kv_cache_usage >= self.overload_kv))

    def _in_region(self, up: list[RemoteEngine]) -> tuple[list[RemoteEngine], str | None]:
        """The up replicas to choose among, by region, and why regions were crossed (None: not)."""
        local = [r for r in up if r.region == self.region]
        if not local:
            return up, "cross_region_down"
        if not all(self.overloaded(r) for r in local):
            return local, None
        away = [r for r in up if r.region != self.region and not self.overloaded(r)]
        return (away, "cross_region_overloaded") if away else (local, None)

    def pick(self, request: EngineRequest, exclude: Iterable[RemoteEngine] = (),
             hashes: Sequence[bytes] | None = None,
             pool: Sequence[RemoteEngine] | None = None) -> tuple[RemoteEngine, str, int]:
        """The replica for ``request``: (replica, reason, prompt pages it holds or will hold).

        With a ``region``, the replicas of that region are chosen among unless all are down
        or overloaded (the reason is then ``cross_region_down`` or ``cross_region_overloaded``).

        Args:
          hashes: the prompt's page hashes (default: computed here).
          pool: the replicas to choose among (default: all).

        Raises:
          EngineOverloadedError: no replica is up (outside ``exclude``).
        """
        exclude = set(map(id, exclude))
        up = [r for r in (self.replicas if pool is None else pool) if r.up and id(r) not in exclude]
        if not up:
            raise EngineOverloadedError("no engine replica is available; retry later")
        parent = self._inflight.get(request.parent_id) if request.parent_id else None
        if parent is not None and parent.replica in up:
            return parent.replica, "parent", 0
        cross = None
        if self.region:
            up, cross = self._in_region(up)
        best, reason, hit = self._pick_by_policy(request, up, hashes)
        return best, cross or reason, hit

    def _pick_by_policy(self, request: EngineRequest, up: list[RemoteEngine],
                        hashes: Sequence[bytes] | None) -> tuple[RemoteEngine, str, int]:
        """The policy's choice among ``up`` (not empty)."""
        start = next(self._rr) % len(up)
        up = up[start:] + up[:start]  # ties go round-robin
        if self.policy == "round-robin":
            return up[0], "round_robin", 0
        loads = [self.requests_on(r) for r in up]
        least = min(range(len(up)), key=loads.__getitem__)
        if self.policy == "least-load":
            return up[least], "least_load", 0
        hi, lo = max(loads), loads[least]
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return up[least], "imbalance", 0
        pages = -(-len(request.prompt_ids) // up[0].page_size)
        best, best_cost, best_hit, best_host = None, None, 0, 0
        by_digest: dict[str | None, tuple[bytes, ...]] = {}  # replicas of one adapter digest hash alike
        for r in up:
            # Pages it holds, or will once the requests in flight there are computed, then
            # the pages its host tier holds right after them (hashed as it hashes them: an
            # adapter request's with the digest of that replica's adapter).
            if hashes is not None:
                mine = hashes
            else:
                digest = r.loras.get(request.lora_name) if request.lora_name is not None else None
                if digest not in by_digest:
                    by_digest[digest] = self.page_hashes(request, r)
                mine = by_digest[digest]
            hit, host = r.kv_index.matched_tiers(mine, self._pending[id(r)])
            cost = self.prefill_weight * (pages - hit - self.host_page_weight * host) + self._pages_on(r)
            if best_cost is None or cost < best_cost:
                best, best_cost, best_hit, best_host = r, cost, hit, host
        reason = "cache_hit" if best_hit else "host_cache_hit" if best_host else "load"
        return best, reason, best_hit

    def page_hashes(self, request: EngineRequest, replica: RemoteEngine) -> tuple[bytes, ...]:
        """The request's prompt page hashes as ``replica``'s prefix cache computes them: salted
        with the request's ``cache_salt`` and, for an adapter request, the digest of the
        adapter ``replica`` serves under that name (``lora_salt``)."""
        digest = replica.loras.get(request.lora_name) if request.lora_name is not None else None
        if request.lora_name is not None and digest is None:
            return ()  # not served there: nothing cached there is its
        return tuple(prompt_page_hashes(request.prompt_ids, replica.page_size,
                                        lora_salt(request.cache_salt, digest), kv_format=replica.kv_format))

    def adapter_pool(self, request: EngineRequest,
                     candidates: Sequence[RemoteEngine] | None) -> list[RemoteEngine] | None:
        """The replicas that may serve ``request``: ``candidates`` (None: all) serving its LoRA
        adapter; ``candidates`` as given for a base-model request.

        Raises:
          RequestRejectedError: no replica serves the adapter.
          EngineOverloadedError: only replicas that are down (or not among ``candidates``) serve it.
        """
        name = request.lora_name
        if name is None:
            return None if candidates is None else list(candidates)
        pool = [r for r in (self.replicas if candidates is None else candidates) if name in r.loras]
        if not pool:
            if any(name in r.loras for r in self.replicas):
                raise EngineOverloadedError(f"no engine replica serving the LoRA adapter {name!r} is "
                                            f"available; retry later")
            raise RequestRejectedError(f"no engine replica serves the LoRA adapter {name!r}")
        return pool

    # -- LoRA adapters ---------------------------------------------------------------------

    @property
    def serves_lora(self) -> bool:
        """Whether some replica takes LoRA adapters."""
        return any(r.serves_lora for r in self.replicas)

    def routed_lora_names(self) -> list[str]:
        """The adapters some replica serves (as last reported), sorted: the gateway lists them."""
        return sorted({n for r in self.replicas for n in r.loras})

    async def load_lora(self, name: str, path: str) -> None:
        """Loads the PEFT folder ``path`` as ``name`` on every up replica that takes adapters; when
        one refuses, those that took it unload it again.

        Raises:
          ValueError: no such replica, or one refused it (the message names it and says why).
          EngineOverloadedError: a replica did not answer (none refused it; retry).
        """
        targets = [r for r in self.replicas if r.up and r.serves_lora]
        if not targets:
            raise ValueError("no engine replica up takes LoRA adapters (started without --max-loras)")
        results = await asyncio.gather(*(r.load_lora(name, path) for r in targets), return_exceptions=True)
        failed = [(r, e) for r, e in zip(targets, results) if isinstance(e, BaseException)]
        if failed:
            took = [r for r, e in zip(targets, results) if not isinstance(e, BaseException)]
            await asyncio.gather(*(r.unload_lora(name) for r in took), return_exceptions=True)
            refused = [(r, e) for r, e in failed if isinstance(e, ValueError)]
            if refused:
                r, e = refused[0]
                raise ValueError(f"engine replica {r.url}: {e}")
            r, e = failed[0]
            raise EngineOverloadedError(f"engine replica {r.url} did not load the LoRA adapter ({e}); retry")

    async def unload_lora(self, name: str) -> None:
        """Unloads adapter ``name`` from every up replica serving it.

        Raises:
          KeyError: no replica serves it.
          LoraInUseError: requests use it on some replica (those without any unloaded it).
          EngineOverloadedError: a replica did not answer (retry).
        """
        targets = [r for r in self.replicas if r.up and name in r.loras]
        if not targets:
            raise KeyError(name)
        results = await asyncio.gather(*(r.unload_lora(name) for r in targets), return_exceptions=True)
        for e in results:
            if isinstance(e, LoraInUseError):
                raise e
        for r, e in zip(targets, results):
            if isinstance(e, BaseException) and not isinstance(e, KeyError):
                raise EngineOverloadedError(f"engine replica {r.url} did not unload the LoRA adapter ({e}); "
                                            f"retry")

    @contextlib.asynccontextmanager
    async def track(self, rid: str, replica: RemoteEngine, hashes: tuple[bytes, ...], pages: int):
        """Counts a request in flight on ``replica`` while the block runs: ``pages`` of load
        there, its prompt's page hashes pending there, and its cancel sent there."""
        self._inflight[rid] = _InFlight(replica, pages, hashes)
        self._pending[id(replica)].update(hashes)
        try:
            yield
        finally:
            self._inflight.pop(rid, None)
            pending = self._pending[id(replica)]
            for h in hashes:
                pending[h] -= 1
                if pending[h] <= 0:
                    del pending[h]

    async def _stream(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        rid = request.request_id
        tried: list[RemoteEngine] = []
        ps = self.replicas[0].page_size
        prefills, decodes = disaggregation.pools(self.replicas)
        pd = bool(prefills and decodes)
        lora = request.lora_name is not None  # hashed per replica (its adapter's digest)
        hashes = (tuple(prompt_page_hashes(request.prompt_ids, ps, request.cache_salt,
                                           kv_format=self.replicas[0].kv_format))
                  if (self.policy == "kv-aware" or pd) and not lora else ())
        if pd and not lora and not disaggregation.wants_colocated(request):
            async for ev in disaggregation.disaggregated(self, request, hashes):
                yield ev
            return
        # Whole requests go to replicas of role both, else decode (each replica is a whole engine).
        whole = [r for r in self.replicas if r.up and r.role == "both"] or decodes or None
        whole = self.adapter_pool(request, whole)
        prompt_pages = -(-len(request.prompt_ids) // ps)
        hops: list[ReplicaRetry] = []
        while True:
            replica, reason, hit = self.pick(request, tried, None if lora else hashes, pool=whole)
            if lora and self.policy == "kv-aware":
                hashes = self.page_hashes(request, replica)
            crossed = reason.startswith("cross_region")
            self.decisions[(replica.url, "retry" if tried and not crossed else reason)] += 1
            pages = prompt_pages - hit + -(-request.sampling.max_tokens // ps)
            where = dict(replica=replica.url, region=replica.region or None, replica_retries=tuple(hops))
            try:
                async with self.track(rid, replica, hashes, pages):
                    async for ev in replica.generate(request):
                        yield dataclasses.replace(ev, **where)
                return
            except ReplicaUnavailable as e:
                log.warning("request %s: %s; trying another replica", rid, e)
                tried.append(replica)
                hops.append(ReplicaRetry(replica.url, replica.region, "unavailable", str(e)))
            except EngineOverloadedError as e:  # its queue is full: another one may take it
                tried.append(replica)
                hops.append(ReplicaRetry(replica.url, replica.region, "overloaded", str(e)))
                if not any(r.up for r in (whole or self.replicas) if r not in tried):
                    raise

    # -- metrics ----------------------------------------------------------------------------

    def collector(self, model_name: str) -> Collector:
        """Per-replica gauges and the decision counter, read at scrape time."""
        return _RouterCollector(self, model_name)


class _RouterCollector(Collector):
    def __init__(self, router: Router, model_name: str) -> None:
        self.router, self.model_name = router, model_name

    def collect(self):
        labels = ["model_name", "replica"]
        families = {
            "up": GaugeMetricFamily("xlaserve:replica_up", "1 while the engine replica takes requests.",
                                    labels=labels),
            "running": GaugeMetricFamily("xlaserve:replica_num_requests_running",
                                         "Requests running on the replica (its last GetLoad).", labels=labels),
            "waiting": GaugeMetricFamily("xlaserve:replica_num_requests_waiting",
                                         "Requests waiting on the replica (its last GetLoad).", labels=labels),
            "kv": GaugeMetricFamily("xlaserve:replica_kv_cache_usage_perc",
                                    "Fraction of the replica's KV pages held (0..1).", labels=labels),
            "hit": GaugeMetricFamily("xlaserve:replica_prefix_cache_hit_rate",
                                     "The replica's prefix-cache hits / queries, in prompt tokens (lifetime).",
                                     labels=labels),
            "inflight": GaugeMetricFamily("xlaserve:replica_gateway_in_flight",
                                          "Requests this gateway has in flight on the replica.", labels=labels),
            "cached": GaugeMetricFamily("xlaserve:replica_cached_pages",
                                        "Prefix-cache pages the router knows the replica holds.", labels=labels),
            "host_cached": GaugeMetricFamily("xlaserve:replica_host_cached_pages",
                                             "Host KV tier pages the router knows the replica holds.",
                                             labels=labels),
        }
        inflight = collections.Counter(f.replica.url for f in self.router._inflight.values())
        for r in self.router.replicas:
            lv = [self.model_name, r.url]
            s = r.load
            families["up"].add_metric(lv, 1.0 if r.up else 0.0)
            families["running"].add_metric(lv, s.num_running)
            families["waiting"].add_metric(lv, s.num_waiting)
            families["kv"].add_metric(lv, s.kv_cache_usage)
            families["hit"].add_metric(lv, s.prefix_cache_hits / s.prefix_cache_queries
                                       if s.prefix_cache_queries else 0.0)
            families["inflight"].add_metric(lv, inflight[r.url])
            families["cached"].add_metric(lv, len(r.kv_index.keys))
            families["host_cached"].add_metric(lv, len(r.kv_index.host_keys))
        decisions = CounterMetricFamily("xlaserve:router_decisions", "Routing decisions by replica and reason.",
                                        labels=["model_name", "replica", "reason"])
        for (url, reason), n in sorted(self.router.decisions.items()):
            decisions.add_metric([self.model_name, url, reason], n)
        where = GaugeMetricFamily("xlaserve:replica_region", "1 per replica, labelled with its region and "
                                  "zone (--labels; empty until it first answers).",
                                  labels=["model_name", "replica", "region", "zone"])
        for r in self.router.replicas:
            labels = r.labels
            where.add_metric([self.model_name, r.url, labels.get("region", ""), labels.get("zone", "")], 1.0)
        yield from families.values()
        yield where
        yield decisions
        t = self.router.transfers  # disaggregated serving's KV transfers
        nbytes = CounterMetricFamily("xlaserve:kv_transfer_bytes",
                                     "Bytes of KV pages decode replicas pulled from prefill replicas.",
                                     labels=["model_name"])
        nbytes.add_metric([self.model_name], t.bytes)
        yield nbytes
        seconds = HistogramMetricFamily("xlaserve:kv_transfer_seconds",
                                        "Seconds from a decode replica's page reservation to its pulled "
                                        "pages in place, per request.", labels=["model_name"])
        seconds.add_metric([self.model_name], [(str(le), n) for le, n in zip(
            disaggregation.TRANSFER_SECONDS_BUCKETS, t.buckets)] + [("+Inf", t.count)], t.seconds_sum)
        yield seconds
