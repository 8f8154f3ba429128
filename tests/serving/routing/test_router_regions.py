"""The router's region preference over stand-in replicas (no gRPC, no engine): requests stay in
the gateway's region, cross only when its replicas are down or overloaded (each reason counted),
and the hops a request took away from failing replicas ride on its events."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from serving.contract.engine_client import EngineStats, ReplicaRetry
from serving.routing.router import Router
from serving.rpc import engine_pb2 as pb
from tests.support.router_fakes import INFO, PS, FakeReplica, drain, prompt, req

SLOTS = pb.ModelInfo()
SLOTS.CopyFrom(INFO)
SLOTS.max_slots = 4  # overloaded at 8 requests (2.0 per slot)


def three(policy="kv-aware"):
    """Two replicas in region "east", one in "west"; a router of region "east"."""
    e1, e2, w = FakeReplica("e1", SLOTS, "east"), FakeReplica("e2", SLOTS, "east"), FakeReplica("w", SLOTS, "west")
    return Router([w, e1, e2], policy=policy, region="east"), e1, e2, w


@pytest.mark.parametrize("policy", ["kv-aware", "least-load", "round-robin"])
def test_requests_stay_in_the_gateways_region(policy):
    router, e1, e2, w = three(policy)
    w.cache(prompt(8 * PS))  # even a cache hit in the other region does not pull it there
    picked = {router.pick(req(prompt(8 * PS) + [k + 1]))[0] for k in range(6)}
    assert picked <= {e1, e2} and w not in picked


def test_a_region_whose_replicas_are_all_down_crosses_and_says_so():
    router, e1, e2, w = three()
    e1.up = False
    assert router.pick(req(prompt(4)))[0] is e2  # one local replica up is enough
    e2.up = False
    r, reason, _ = router.pick(req(prompt(4)))
    assert (r, reason) == (w, "cross_region_down")
    e1.up = True  # back: home again
    assert router.pick(req(prompt(4)))[:2] == (e1, "load")


def test_overloaded_local_replicas_spill_to_another_region_only_if_it_is_not():
    router, e1, e2, w = three()
    e1.load = EngineStats(num_running=4, num_waiting=4)  # 8 requests on 4 slots: overloaded
    assert router.overloaded(e1) and not router.overloaded(e2)
    r, reason, _ = router.pick(req(prompt(4)))  # one local replica with room: no crossing
    assert r in (e1, e2) and reason == "load"
    e2.load = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.97)  # KV full, requests waiting
    assert router.overloaded(e2)
    assert router.pick(req(prompt(4)))[:2] == (w, "cross_region_overloaded")
    w.load = EngineStats(num_running=4, num_waiting=9)  # everyone overloaded: stay home
    r, reason, _ = router.pick(req(prompt(4)))
    assert r in (e1, e2) and not reason.startswith("cross_region")


def test_a_failover_across_regions_carries_its_hops_and_counts_its_reason():
    """The local replicas fail before their first event: the request goes to the other region;
    its events name that replica, its region and each replica it left, and why."""
    router, e1, e2, w = three("round-robin")
    e1.fail_before_first = e2.fail_before_first = True
    evs = asyncio.run(drain(router, req(prompt(4), "f1")))
    assert [ev.replica for ev in evs] == [w.url, w.url] and evs[-1].finish_reason == "length"
    assert {ev.region for ev in evs} == {"west"}
    hops = evs[-1].replica_retries
    assert sorted((h.replica, h.region, h.reason) for h in hops) == [
        (e1.url, "east", "unavailable"), (e2.url, "east", "unavailable")]
    assert all("UNAVAILABLE" in h.error for h in hops)
    # The first local try counts as usual, the second as a retry, the crossing by its reason.
    counted = {reason for (url, reason), n in router.decisions.items() if n}
    assert counted == {"round_robin", "retry", "cross_region_down"}
    assert router.decisions[(w.url, "cross_region_down")] == 1
    # Both east replicas are out now: the next request crosses with no hop at all.
    evs = asyncio.run(drain(router, req(prompt(4), "f2")))
    assert evs[-1].replica == w.url and evs[-1].replica_retries == ()
    assert router.decisions[(w.url, "cross_region_down")] == 2
    reg = CollectorRegistry()
    reg.register(router.collector("m"))
    text = generate_latest(reg).decode()
    assert f'xlaserve:router_decisions_total{{model_name="m",reason="cross_region_down",replica="{w.url}"}} 2.0' in text
    assert f'xlaserve:replica_region{{model_name="m",region="west",replica="{w.url}",zone=""}} 1.0' in text


def test_an_overloaded_refusal_is_a_hop_too():
    router, e1, e2, w = three("round-robin")
    e2.up = False
    e1.overloaded = True  # its queue is full: it refuses
    evs = asyncio.run(drain(router, req(prompt(4), "o1")))
    assert evs[-1].replica == w.url
    assert evs[-1].replica_retries == (ReplicaRetry(e1.url, "east", "overloaded", f"{e1.url}: queue full"),)


def test_without_a_region_or_labels_nothing_changes():
    e, w = FakeReplica("e", SLOTS, "east"), FakeReplica("w", SLOTS, "west")
    router = Router([e, w], policy="round-robin")
    assert {router.pick(req(prompt(4)))[1] for _ in range(4)} == {"round_robin"}
    assert {router.pick(req(prompt(4)))[0] for _ in range(4)} == {e, w}
    # A region no replica is labelled with: every decision crosses, and is counted so.
    router = Router([FakeReplica("a"), FakeReplica("b")], policy="round-robin", region="east")
    assert router.pick(req(prompt(4)))[1] == "cross_region_down"


def test_labels_parse_and_are_known_only_once_the_replica_answered():
    from serving.cli.engine import parse_labels
    from serving.rpc.remote_engine import RemoteEngine

    assert parse_labels("region=eu-west, zone=b") == {"region": "eu-west", "zone": "b"}
    assert parse_labels(None) == parse_labels("") == {}
    for bad in ("region", "=x", "region=a,region=b"):
        with pytest.raises(ValueError, match="--labels"):
            parse_labels(bad)
    labelled = pb.ModelInfo()
    labelled.CopyFrom(SLOTS)
    labelled.labels.update({"region": "eu-west", "zone": "b"})
    assert RemoteEngine("grpc://h:1", labelled).region == "eu-west"
    # Not answered yet: the expected info is another replica's, and so are its labels.
    assert RemoteEngine("grpc://h:2", None, expected=labelled).labels == {}
