"""Per-key and per-tenant rate limits: requests/min, tokens/min, concurrent requests.

Each per-minute limit is a token bucket (capacity = the limit, refilled at
limit/60 per second), the usual shape of API rate limits: a client may burst
up to the limit, then proceeds at the steady rate. Tokens are reserved at
admission (prompt tokens + ``max_tokens``) and settled at the end to the real
``prompt_tokens + completion_tokens``: the unused part is given back.

Decisions are all-or-nothing: a request is admitted only if every applicable
limit (key and tenant; requests, tokens, concurrency) has room, and then it
takes from all of them. State is in process memory: each gateway process
enforces its own share. Several gateways share limits through Redis instead
(``redis_rate_limit.py``, the same semantics behind the :class:`Limiter` interface).

Changing a key's or a tenant's limits while it runs carries its state over:
requests in flight keep their concurrency slots (and give them back to the same
state when they end), and a bucket keeps what was taken from it (its level is
the new capacity less what the old one had used), so a change never refills a
bucket nor leaks a slot.

Response headers follow OpenAI's: ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests`` (time until
the bucket is full again, e.g. "1.5s", "6m0s") and the same for ``-tokens``,
reporting the tighter of the key's and the tenant's buckets.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any, Callable, Protocol

from serving.gateway.accounts.api_keys import Limits, Principal

LIMIT_NAMES = ("requests", "tokens", "concurrent")


class TokenBucket:
    """A bucket of `capacity` units refilled at `capacity / 60` per second."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.updated = now

    def resized(self, capacity: int | None, now: float) -> "TokenBucket | None":
        """This bucket under a new limit (None: no bucket), refilled to `now` first and
        keeping what was taken from it: level = new capacity - (old capacity - old level)."""
        if not capacity:
            return None
        self.refill(now)
        out = TokenBucket(capacity, now)
        out.level = max(min(out.capacity, out.capacity - (self.capacity - self.level)), -out.capacity)
        return out

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, n: float) -> float:
        """Seconds until `n` units are available (inf if n > capacity)."""
        if n > self.capacity:
            return math.inf
        return max(0.0, (n - self.level) / self.rate)

    def reset_after(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.level) / self.rate


class RateLimited(Exception):
    """A request over a limit.

    Attributes:
      scope: "key" or "tenant".
      limit: "requests", "tokens" or "concurrent".
      value: the configured limit.
      retry_after: seconds until a retry can succeed (inf: never, the request
        alone exceeds the limit).
      headers: the ``x-ratelimit-*`` headers at the time of rejection.
    """

    def __init__(self, scope: str, limit: str, value: int, retry_after: float,
                 headers: dict[str, str], needed: int = 1) -> None:
        self.scope, self.limit, self.value = scope, limit, value
        self.retry_after, self.headers, self.needed = retry_after, headers, needed
        unit = {"requests": "requests per minute", "tokens": "tokens per minute",
                "concurrent": "concurrent requests"}[limit]
        if math.isinf(retry_after):
            msg = (f"Request too large for the {scope}'s limit of {value} {unit}: it needs "
                   f"{needed} tokens (prompt + max_tokens). Lower max_tokens or the prompt.")
        else:
            msg = (f"Rate limit reached: the {scope}'s limit of {value} {unit}. "
                   f"Retry after {retry_after:.1f} s.")
        super().__init__(msg)


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s}s"


@dataclasses.dataclass
class ScopeState:
    """The buckets and concurrency counter of one key or tenant (``active``: requests in flight)."""

    limits: Limits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    active: int = 0


@dataclasses.dataclass
class Admission:
    """An admitted request's hold on its limits; settle once at the end.

    Attributes:
      reserved_tokens: tokens taken at admission.
      decisions: what was checked, for the request's trace:
        [{"scope", "limit", "value", "remaining"}].
      headers: ``x-ratelimit-*`` headers after admission.
    """

    reserved_tokens: int
    decisions: list[dict]
    headers: dict[str, str]
    _limiter: "Limiter"
    _scopes: list[Any]  # what the limiter took, for its _settle: ScopeStates, or a Redis lease
    settled_tokens: int | None = None

    def settle(self, used_tokens: int) -> None:
        """Gives back unused reserved tokens and the concurrency slot. Idempotent."""
        if self.settled_tokens is not None:
            return
        self.settled_tokens = used_tokens
        self._limiter._settle(self, used_tokens)


class Limiter(Protocol):
    """What metering asks of rate limits: :class:`RateLimiter` (per process) or
    :class:`~serving.gateway.accounts.redis_rate_limit.RedisRateLimiter` (shared through Redis).

    ``blocking``: its calls wait on the network (Redis), so the gateway makes them in a worker
    thread, never on the event loop."""

    blocking: bool

    def admit(self, principal: Principal, tokens: int) -> Admission: ...

    def headers(self, principal: Principal) -> dict[str, str]: ...

    def close(self) -> None: ...

    def _settle(self, adm: Admission, used: int) -> None: ...


class RateLimiter:
    """Holds every key's and tenant's buckets in process memory (thread-safe).

    Args:
      clock: seconds, monotonic (injectable for tests).
    """

    blocking = False  # memory and a lock: cheap enough for the event loop

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._scopes: dict[tuple[str, str], ScopeState] = {}

    def _scope(self, kind: str, name: str, limits: Limits, now: float) -> ScopeState | None:
        if limits == Limits():
            return None
        s = self._scopes.get((kind, name))
        if s is None:
            s = ScopeState(limits,
                           TokenBucket(limits.rpm, now) if limits.rpm else None,
                           TokenBucket(limits.tpm, now) if limits.tpm else None)
            self._scopes[(kind, name)] = s
        elif s.limits != limits:  # changed: the same state, so admissions in flight settle against it
            s.requests = (s.requests.resized(limits.rpm, now) if s.requests
                          else TokenBucket(limits.rpm, now) if limits.rpm else None)
            s.tokens = (s.tokens.resized(limits.tpm, now) if s.tokens
                        else TokenBucket(limits.tpm, now) if limits.tpm else None)
            s.limits = limits
        return s

    def _scopes_of(self, p: Principal, now: float) -> list[tuple[str, ScopeState]]:
        out = []
        if p.key_id is not None:
            s = self._scope("key", p.key_id, p.key_limits, now)
            if s:
                out.append(("key", s))
        s = self._scope("tenant", p.tenant, p.tenant_limits, now)
        if s:
            out.append(("tenant", s))
        return out

    def _refilled_scopes(self, p: Principal) -> list[tuple[str, ScopeState]]:
        now = self.clock()
        scopes = self._scopes_of(p, now)
        for _, s in scopes:
            for b in (s.requests, s.tokens):
                if b:
                    b.refill(now)
        return scopes

    def admit(self, principal: Principal, tokens: int) -> Admission:
        """Takes one request, `tokens` tokens and a concurrency slot from every applicable limit.

        Raises:
          RateLimited: some limit has no room (nothing is taken then).
        """
        with self._lock:
            scopes = self._refilled_scopes(principal)
            exceeded = first_exceeded(scopes, tokens)
            if exceeded is not None:
                raise exceeded
            decisions = []
            for kind, s in scopes:
                if s.requests:
                    s.requests.level -= 1
                if s.tokens:
                    s.tokens.level -= tokens
                s.active += 1
                decisions.append(decision_of(kind, s))
            return Admission(tokens, decisions, rate_limit_headers(scopes), self, [s for _, s in scopes])

    def headers(self, principal: Principal) -> dict[str, str]:
        """The current ``x-ratelimit-*`` headers of `principal` (empty when unlimited)."""
        with self._lock:
            return rate_limit_headers(self._refilled_scopes(principal))

    def close(self) -> None:
        """Nothing to release (the state is this process's memory)."""

    def _settle(self, adm: Admission, used: int) -> None:
        with self._lock:
            now = self.clock()
            for s in adm._scopes:
                s.active = max(0, s.active - 1)
                if s.tokens:
                    s.tokens.refill(now)
                    s.tokens.level = min(s.tokens.capacity, s.tokens.level + adm.reserved_tokens - used)


def first_exceeded(scopes: list[tuple[str, ScopeState]], tokens: int) -> RateLimited | None:
    """The first limit without room for one more request of `tokens` tokens (None: all have room).

    Scopes are checked in order (key, then tenant), each for requests, tokens, then concurrency.
    """
    for kind, s in scopes:
        if s.requests and s.requests.level < 1:
            return RateLimited(kind, "requests", s.limits.rpm, s.requests.wait_for(1),
                               rate_limit_headers(scopes))
        if s.tokens and s.tokens.level < tokens:
            return RateLimited(kind, "tokens", s.limits.tpm, s.tokens.wait_for(tokens),
                               rate_limit_headers(scopes), needed=tokens)
        if s.limits.max_concurrent and s.active >= s.limits.max_concurrent:
            return RateLimited(kind, "concurrent", s.limits.max_concurrent, 1.0, rate_limit_headers(scopes))
    return None


def decision_of(kind: str, s: ScopeState) -> dict:
    """A scope's entry in an admitted request's trace (remaining: whole units left)."""
    return {
        "scope": kind,
        "requests_limit": s.limits.rpm,
        "requests_remaining": None if not s.requests else int(s.requests.level),
        "tokens_limit": s.limits.tpm,
        "tokens_remaining": None if not s.tokens else int(s.tokens.level),
        "concurrent_limit": s.limits.max_concurrent,
        "concurrent_active": s.active,
    }


def rate_limit_headers(scopes: list[tuple[str, ScopeState]]) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of (kind, state) scopes: per limit, the emptiest bucket's."""
    out: dict[str, str] = {}
    for name, attr, limit_attr in (("requests", "requests", "rpm"), ("tokens", "tokens", "tpm")):
        buckets = [(getattr(s, attr), getattr(s.limits, limit_attr)) for _, s in scopes if getattr(s, attr)]
        if not buckets:
            continue
        b, limit = min(buckets, key=lambda x: x[0].level)
        out[f"x-ratelimit-limit-{name}"] = str(limit)
        out[f"x-ratelimit-remaining-{name}"] = str(max(0, int(b.level)))
        out[f"x-ratelimit-reset-{name}"] = format_duration(b.reset_after())
    return out
