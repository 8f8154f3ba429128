"""Disaggregated serving through the router: a prompt computed on a prefill replica, its
decoding on a decode replica, the KV pages moving between them (``serving.replica.kv_connector``).

Given up replicas of role ``prefill`` and of role ``decode`` (``GetModelInfo``),
:meth:`serving.routing.router.Router.submit` sends each request in two hops:

1. to a prefill replica chosen as the router's policy chooses (kv-aware: where
   its prompt's pages are cached), as a ``kv_produce`` request with
   ``max_tokens`` 1 and nothing the first token alone does not need (no stop
   words, log probabilities or structured output): the replica computes the
   prompt, keeps its full pages and answers with their :class:`KvTransferParams`;
2. to the decode replica with the least load, with those params (and the prefill
   replica's URL): it pulls the pages its own cache lacks, computes the rest of
   the prompt, samples and decodes. Its events are the request's, carrying
   ``prefill_replica`` and the bytes and seconds of the pull.

Only replicas with the same ``--kv-transport`` pair (a prefill replica no decode
replica can pull from takes no prompts; :func:`unpaired` says why, in the
gateway's start-up log). Requests that need the prompt computed in their own
slot (prompt log probabilities, penalties: they take no prefix-cache hit) and
the ``n`` choices of one prompt go to a decode replica whole. A prefill replica that fails before
answering is replaced by the next (none left: the decode replica computes the
prompt itself); a decode replica that fails before its first event is replaced
by the next, which pulls the same offer (it waits on the prefill side until its
``--kv-transfer-timeout``); a failure after that ends the request with an
"error" event, as with co-located replicas. ``cached_tokens`` is the prefill
replica's: the prompt tokens nobody computed for this request.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import AsyncContextManager, AsyncIterator, Iterable, Protocol, Sequence

from serving.contract.engine_client import EngineOverloadedError, EngineRequest, TokenEvent
from serving.rpc.remote_engine import RemoteEngine, ReplicaUnavailable

log = logging.getLogger("xlaserve.router")

TRANSFER_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def wants_colocated(request: EngineRequest) -> bool:
    """Whether the request must compute its prompt where it decodes (no prefix-cache hit there)."""
    s = request.sampling
    return (s.prompt_logprobs is not None or s.presence_penalty != 0 or s.frequency_penalty != 0
            or s.repetition_penalty not in (0, 1) or request.parent_id is not None)


def prefill_hop(request: EngineRequest) -> EngineRequest:
    """The request as its prefill replica computes it: the prompt and one token."""
    s = dataclasses.replace(request.sampling, max_tokens=1, min_tokens=0, logprobs=None, stop_token_ids=(),
                            structured_output=None, logit_bias=())
    return dataclasses.replace(request, sampling=s, kv_produce=True)


@dataclasses.dataclass
class TransferStats:
    """KV transfers the router saw end (for its metrics): count, bytes, latency histogram."""

    count: int = 0
    bytes: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(TRANSFER_SECONDS_BUCKETS))

    def observe(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds_sum += seconds
        for i, le in enumerate(TRANSFER_SECONDS_BUCKETS):
            if seconds <= le:
                self.buckets[i] += 1


def pools(replicas: Sequence[RemoteEngine], transport: str | None = None
          ) -> tuple[list[RemoteEngine], list[RemoteEngine]]:
    """The up replicas of role prefill that some up decode replica can pull from (the same
    ``--kv-transport``), and the up decode replicas (of ``transport`` if given)."""
    up = [r for r in replicas if r.up]
    decodes = [r for r in up if r.role == "decode" and transport in (None, r.kv_transport)]
    pullable = {r.kv_transport for r in decodes}
    return [r for r in up if r.role == "prefill" and r.kv_transport in pullable], decodes


def unpaired(replicas: Sequence[RemoteEngine]) -> list[str]:
    """Why some prefill replicas can hand their pages to no decode replica (mismatched
    ``--kv-transport``), one line each; empty when every prefill replica pairs."""
    replicas = [r for r in replicas if r.info is not None]  # (those that answered)
    decode_transports = {r.kv_transport for r in replicas if r.role == "decode"}
    if not decode_transports:
        return []
    return [f"prefill replica {r.url} offers KV pages over {r.kv_transport!r}, but the decode replicas "
            f"pull over {', '.join(sorted(map(repr, decode_transports)))}: give them the same --kv-transport"
            for r in replicas if r.role == "prefill" and r.kv_transport not in decode_transports]


class RouterView(Protocol):
    """What the two hops use of the router (:class:`serving.routing.router.Router`, which
    imports this module): its replicas, its choice of one, its in-flight accounting and counters."""

    replicas: list[RemoteEngine]
    decisions: collections.Counter[tuple[str, str]]
    transfers: TransferStats

    def pick(self, request: EngineRequest, exclude: Iterable[RemoteEngine] = (),
             hashes: Sequence[bytes] | None = None,
             pool: Sequence[RemoteEngine] | None = None) -> tuple[RemoteEngine, str, int]: ...

    def track(self, rid: str, replica: RemoteEngine, hashes: tuple[bytes, ...],
              pages: int) -> AsyncContextManager[None]: ...

    def requests_on(self, r: RemoteEngine) -> int: ...


async def disaggregated(router: RouterView, request: EngineRequest, hashes: tuple[bytes, ...]
                        ) -> AsyncIterator[TokenEvent]:
    """The request's events, served in two hops (see the module docstring).

    Raises:
      EngineOverloadedError: no decode replica would take it.
    """
    rid = request.request_id
    ps = router.replicas[0].page_size
    prompt_pages = -(-len(request.prompt_ids) // ps)
    tried: list[RemoteEngine] = []
    offer, first = None, None
    prefill = None
    while offer is None:
        prefills, _ = pools(router.replicas)
        candidates = [r for r in prefills if r not in tried]
        if not candidates:
            break  # no prefill replica: the decode replica computes the prompt itself
        prefill, reason, hit = router.pick(request, tried, hashes, pool=candidates)
        router.decisions[(prefill.url, "prefill_retry" if tried else f"prefill_{reason}")] += 1
        try:
            async with router.track(rid, prefill, hashes, prompt_pages - hit):
                async for ev in prefill.generate(prefill_hop(request)):
                    if ev.finish_reason is None:
                        continue
                    if ev.finish_reason == "cancelled":
                        yield dataclasses.replace(ev, token_ids=(), replica=prefill.url)
                        return
                    if ev.finish_reason == "error" or ev.kv_transfer is None:
                        yield dataclasses.replace(ev, token_ids=(), finish_reason="error", replica=prefill.url,
                                                  error=ev.error or "the prefill replica offered no KV pages")
                        return
                    offer, first = dataclasses.replace(ev.kv_transfer, source_url=prefill.url), ev
        except (ReplicaUnavailable, EngineOverloadedError) as e:
            log.warning("request %s: prefill replica %s: %s; trying another", rid, prefill.url, e)
            tried.append(prefill)
    decode_req = request if offer is None else dataclasses.replace(request, kv_transfer=offer)
    tried_decode: list[RemoteEngine] = []
    while True:
        _, decodes = pools(router.replicas, offer.transport if offer is not None else None)
        candidates = [r for r in decodes if r not in tried_decode]
        if not candidates:
            if offer is not None:
                await prefill.release_kv(offer.transfer_id)
            raise EngineOverloadedError("no decode replica is available; retry later")
        decode = min(candidates, key=router.requests_on)
        router.decisions[(decode.url, "decode_retry" if tried_decode else "decode")] += 1
        try:
            async with router.track(rid, decode, hashes, prompt_pages + -(-request.sampling.max_tokens // ps)):
                async for ev in decode.generate(decode_req):
                    if ev.finish_reason is not None and offer is not None:
                        router.transfers.observe(ev.kv_transfer_bytes, ev.kv_transfer_seconds)
                    yield dataclasses.replace(
                        ev, replica=decode.url, prefill_replica=prefill.url if offer is not None else None,
                        cached_tokens=first.cached_tokens if first is not None else ev.cached_tokens,
                        scheduled_time=first.scheduled_time if first is not None else ev.scheduled_time)
            return
        except (ReplicaUnavailable, EngineOverloadedError) as e:
            log.warning("request %s: decode replica %s: %s; trying another", rid, decode.url, e)
            tried_decode.append(decode)
