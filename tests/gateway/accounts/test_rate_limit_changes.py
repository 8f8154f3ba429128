"""Changing a tenant's limits while its requests run carries its rate-limit state over: the
requests in flight keep (and give back) their concurrency slots, and a changed bucket keeps
what was taken from it instead of starting full. The in-process limiter on a frozen clock."""

from __future__ import annotations

import pytest

from serving.gateway.accounts.api_keys import Limits, Principal
from serving.gateway.accounts.rate_limit import RateLimited, RateLimiter


def _acme(**limits) -> Principal:
    return Principal(tenant="acme", key_id=None, tenant_limits=Limits(**limits))


def test_a_limit_change_keeps_the_concurrency_slots_in_flight():
    limiter = RateLimiter(clock=lambda: 100.0)
    first = limiter.admit(_acme(max_concurrent=1), 1)
    with pytest.raises(RateLimited):
        limiter.admit(_acme(max_concurrent=1), 1)
    raised = _acme(max_concurrent=2, tpm=10_000)  # changed while `first` runs
    second = limiter.admit(raised, 1)
    with pytest.raises(RateLimited) as e:
        limiter.admit(raised, 1)  # two in flight: `first` still holds its slot
    assert e.value.limit == "concurrent"
    first.settle(1)
    second.settle(1)
    held = [limiter.admit(raised, 1) for _ in range(2)]  # both slots came back, none leaked
    with pytest.raises(RateLimited):
        limiter.admit(raised, 1)
    for a in held:
        a.settle(1)


def test_a_limit_change_does_not_refill_the_buckets():
    limiter = RateLimiter(clock=lambda: 100.0)
    for _ in range(2):
        limiter.admit(_acme(rpm=2, tpm=100), 40).settle(40)
    with pytest.raises(RateLimited):
        limiter.admit(_acme(rpm=2, tpm=100), 1)
    limiter.admit(_acme(rpm=3, tpm=100), 1).settle(1)  # one more request: 2 of 3 were taken
    with pytest.raises(RateLimited) as e:
        limiter.admit(_acme(rpm=3, tpm=100), 1)
    assert e.value.limit == "requests"
    with pytest.raises(RateLimited) as e:
        limiter.admit(_acme(rpm=10, tpm=120), 40)  # 81 of 100 tokens used: 39 left under 120
    assert e.value.limit == "tokens"
    limiter.admit(_acme(rpm=10, tpm=120), 39)
