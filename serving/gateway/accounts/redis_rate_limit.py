"""Rate limits shared by several gateways through Redis: the same limits as ``rate_limit.py``.

:class:`RedisRateLimiter` has :class:`~serving.gateway.accounts.rate_limit.RateLimiter`'s
interface and semantics (per key and per tenant: requests/min and tokens/min
as token buckets of capacity = the limit refilled at limit/60 per second,
concurrent requests; all-or-nothing admission; tokens reserved at admission
and the unused part given back at settlement; the same ``Admission``,
``RateLimited``, ``x-ratelimit-*`` headers and trace decisions), with the
state in Redis instead of process memory, so every gateway using one Redis
enforces one set of limits.

Design:

* **One Lua script per decision** (``EVALSHA``, loaded by redis-py's
  ``register_script``). Redis runs a script atomically, so admission reads and
  updates the key's and the tenant's buckets and leases in one step: a
  request takes from all of them or from none, whichever gateway asks.
  Settlement (release the lease, give back unused tokens) is one script too.
  This is the token-bucket-in-Lua pattern of Stripe's "Scaling your API with
  rate limiters" (2017). GCRA (redis-cell; Brandur Leach, "Rate limiting,
  cells, and GCRA") would store one timestamp per bucket instead of a level
  and its update time; a level keeps settlement's give-back a plain addition
  and the arithmetic that of ``rate_limit.TokenBucket``.
* **Buckets are hashes** ``{level, updated, capacity}``, refilled lazily when
  read. Times are Redis's own clock (``TIME`` inside the script; Redis >= 5
  replicates scripts by their effects, so a script may read the time before
  writing), never a gateway's, so gateways whose clocks disagree still agree
  on every bucket. A bucket stored with another capacity (its limit was
  changed) keeps what was taken from it, as in process. A bucket expires once it would
  be full again: a full bucket and a missing one are the same.
* **Concurrency is leases with a TTL**: a sorted set per scope of lease id ->
  expiry (Redis time). Admission drops the expired ones, counts the rest
  against ``max_concurrent`` and adds its own; settlement removes it. This is
  the counting semaphore of "Redis in Action" (J. Carlson, 2013, section 6.3),
  with the expiry as the score. A gateway that dies leaves leases that
  lapse after :data:`LEASE_TTL_S` (30 s); its slots come back then.
* **Renewal**: a request may run longer than any fixed TTL (a long stream),
  and the gateway has no request timeout to size a TTL against, so a
  background thread renews this gateway's unsettled leases every third of
  the TTL (10 s). It holds admissions weakly: one dropped without settling
  stops being renewed and lapses too.
* **Redis unreachable: fail open to this gateway's own limits.** When Redis
  does not answer a decision (connection refused, a timeout of
  :data:`SOCKET_TIMEOUT_S`, any Redis error), the request is decided by a
  per-process :class:`~serving.gateway.accounts.rate_limit.RateLimiter` instead,
  exactly as without ``--redis-url``: serving goes on with limits per gateway
  rather than none, and an outage of Redis is not an outage of the API (the
  default of Envoy's rate-limit filter, ``failure_mode_deny: false``, too). A
  warning is logged, each decision in the trace says so (``"note"``), and
  Redis is tried again after :data:`REDIS_RETRY_S` (1 s), so a Redis that
  hangs costs one timeout per second, not one per request. Settling an
  admission Redis made is attempted even then; if it fails its lease lapses
  by its TTL and its unused tokens are not given back.

Keys (all under ``xlaserve:rl:``; the tenant in braces is a Redis Cluster hash
tag, so that a key's and its tenant's keys, which one script uses, would share
a slot; the client here talks to one Redis server)::

    xlaserve:rl:{TENANT}:key:KEY_ID:requests | :tokens | :leases
    xlaserve:rl:{TENANT}:tenant:requests     | :tokens | :leases

The client is redis-py's synchronous one, called from worker threads, never on
the event loop (:attr:`RedisRateLimiter.blocking`: ``Metering.admit_async``, the
settlement at a request's end and the headers of the gateway's auth dependency
hop to a thread, so a Redis that hangs for its timeout stalls only the request
that asked; a decision is one round trip, well under a millisecond on loopback), with
:data:`SOCKET_TIMEOUT_S` on connecting and on every reply and no retries
(a script whose reply was lost may have run: retrying could take twice).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
import weakref
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from serving.gateway.accounts.api_keys import Limits, Principal
from serving.gateway.accounts.rate_limit import (
    Admission,
    RateLimiter,
    ScopeState,
    TokenBucket,
    decision_of,
    first_exceeded,
    rate_limit_headers,
)

log = logging.getLogger("xlaserve.gateway")

REDIS_URL_ENV = "XLASERVE_REDIS_URL"
KEY_PREFIX = "xlaserve:rl:"

LEASE_TTL_S = 30.0
"""Seconds a concurrency lease lives unless renewed: a dead gateway's slots come back within this."""

SOCKET_TIMEOUT_S = 0.25
"""Seconds to connect to Redis, and to wait for each reply, before failing open."""

REDIS_RETRY_S = 1.0
"""Seconds after a failed decision during which decisions skip Redis (this gateway's own limits)."""

FALLBACK_NOTE = "Redis unreachable: this gateway's own limits"
"""The ``note`` of each trace decision made without Redis."""


def default_redis_url() -> str | None:
    """``$XLASERVE_REDIS_URL``, else None (limits per gateway process)."""
    return os.environ.get(REDIS_URL_ENV) or None


# Shared by the scripts: Redis's time, and token buckets kept in hashes {level, updated, capacity}.
_LUA_BUCKETS = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function fmt(x) return string.format('%.17g', x) end

-- A bucket's (level, updated) at `now`, refilled at capacity/60 per second. A missing bucket is
-- full; one stored with another capacity (its limit changed) keeps what was taken from it:
-- level = capacity - (old capacity - old level), as rate_limit.TokenBucket.resized.
local function bucket(key, capacity, now)
  local b = redis.call('HMGET', key, 'level', 'updated', 'capacity')
  if not b[1] then return capacity, now end
  local level, updated, old = tonumber(b[1]), tonumber(b[2]), tonumber(b[3])
  if now > updated then
    level = math.min(old, level + (now - updated) * old / 60)
    updated = now
  end
  if old ~= capacity then
    level = math.max(-capacity, math.min(capacity, capacity - (old - level)))
  end
  return level, updated
end

-- Stores a bucket, to expire once it would be full again.
local function store(key, capacity, level, updated)
  redis.call('HSET', key, 'level', fmt(level), 'updated', fmt(updated), 'capacity', fmt(capacity))
  redis.call('PEXPIRE', key, string.format('%d', math.ceil((capacity - level) * 60000 / capacity) + 1000))
end

-- The leases set lives at least as long as its newest lease.
local function keep_leases(key, ttl_ms)
  if redis.call('PTTL', key) < ttl_ms + 1000 then
    redis.call('PEXPIRE', key, string.format('%d', ttl_ms + 1000))
  end
end
"""

_ADMIT_LUA = _LUA_BUCKETS + """
-- KEYS: per scope, its requests bucket, tokens bucket and leases.
-- ARGV: tokens, lease id, lease TTL (ms), then per scope rpm, tpm, max_concurrent (0: no limit).
-- Returns {admitted (1/0), then per scope: requests level, tokens level ('' if no limit),
-- leases held}: after taking when admitted, as found when not (nothing is taken then).
local need, lease, ttl_ms = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local now = now_s()
local scopes = {}
for i = 1, #KEYS / 3 do
  local s = {rk = KEYS[3 * i - 2], tk = KEYS[3 * i - 1], lk = KEYS[3 * i],
             rpm = tonumber(ARGV[3 * i + 1]), tpm = tonumber(ARGV[3 * i + 2]),
             conc = tonumber(ARGV[3 * i + 3])}
  if s.rpm > 0 then s.rl, s.ru = bucket(s.rk, s.rpm, now) end
  if s.tpm > 0 then s.tl, s.tu = bucket(s.tk, s.tpm, now) end
  redis.call('ZREMRANGEBYSCORE', s.lk, '-inf', fmt(now))  -- lapsed leases: their gateways are gone
  s.active = redis.call('ZCARD', s.lk)
  scopes[i] = s
end
local function reply(admitted)
  local out = {admitted}
  for _, s in ipairs(scopes) do
    out[#out + 1] = s.rl and fmt(s.rl) or ''
    out[#out + 1] = s.tl and fmt(s.tl) or ''
    out[#out + 1] = s.active
  end
  return out
end
-- Any limit without room refuses the request (rate_limit.first_exceeded names the first).
for _, s in ipairs(scopes) do
  if (s.rl and s.rl < 1) or (s.tl and s.tl < need) or (s.conc > 0 and s.active >= s.conc) then
    return reply(0)
  end
end
for _, s in ipairs(scopes) do
  if s.rl then s.rl = s.rl - 1; store(s.rk, s.rpm, s.rl, s.ru) end
  if s.tl then s.tl = s.tl - need; store(s.tk, s.tpm, s.tl, s.tu) end
  redis.call('ZADD', s.lk, fmt(now + ttl_ms / 1000), lease)
  keep_leases(s.lk, ttl_ms)
  s.active = s.active + 1
end
return reply(1)
"""

_SETTLE_LUA = _LUA_BUCKETS + """
-- KEYS: per scope, its tokens bucket and leases. ARGV: lease id, tokens to give back
-- (reserved - used), then per scope tpm (0: no limit). Releases the lease, gives the tokens back.
local lease, give = ARGV[1], tonumber(ARGV[2])
local now = now_s()
for i = 1, #KEYS / 2 do
  local tk, lk, tpm = KEYS[2 * i - 1], KEYS[2 * i], tonumber(ARGV[2 + i])
  redis.call('ZREM', lk, lease)
  if tpm > 0 and give ~= 0 then
    local level, updated = bucket(tk, tpm, now)
    store(tk, tpm, math.min(tpm, level + give), updated)
  end
end
return 1
"""

_RENEW_LUA = _LUA_BUCKETS + """
-- KEYS: the leases sets holding a lease. ARGV: lease id, lease TTL (ms).
-- Moves the lease's expiry to now + TTL where it is still held. Returns how many were.
local lease, ttl_ms = ARGV[1], tonumber(ARGV[2])
local now = now_s()
local held = 0
for _, lk in ipairs(KEYS) do
  if redis.call('ZSCORE', lk, lease) then
    redis.call('ZADD', lk, 'XX', fmt(now + ttl_ms / 1000), lease)
    keep_leases(lk, ttl_ms)
    held = held + 1
  end
end
return held
"""

_LEVELS_LUA = _LUA_BUCKETS + """
-- KEYS: per scope, its requests and tokens buckets. ARGV: per scope rpm, tpm (0: no limit).
-- Returns per scope the requests and tokens levels now ('' if no limit). Writes nothing.
local now = now_s()
local out = {}
for i = 1, #KEYS / 2 do
  local rpm, tpm = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  out[#out + 1] = rpm > 0 and fmt((bucket(KEYS[2 * i - 1], rpm, now))) or ''
  out[#out + 1] = tpm > 0 and fmt((bucket(KEYS[2 * i], tpm, now))) or ''
end
return out
"""


@dataclasses.dataclass(frozen=True)
class _ScopeKeys:
    """One key's or tenant's limits and the Redis keys of its buckets and leases."""

    kind: str  # "key" or "tenant"
    limits: Limits
    requests: str
    tokens: str
    leases: str


@dataclasses.dataclass(frozen=True)
class _Lease:
    """What a Redis admission holds: its lease id in each scope's leases set."""

    lease_id: str
    scopes: tuple[_ScopeKeys, ...]


class RedisRateLimiter:
    """Per-key and per-tenant limits kept in Redis, shared by every gateway using it (thread-safe).

    Args:
      url: a redis-py URL, ``redis://[:password@]host:port/db`` (or ``rediss://``, ``unix://``).
      prefix: of every Redis key it uses.
      lease_ttl_s: seconds a concurrency lease lives unless renewed; renewed every third of it.
      socket_timeout_s: seconds to connect and to wait for each reply.
      redis_retry_s: seconds after a failed decision during which decisions skip Redis.
      clock: seconds, monotonic: when to try Redis again, and the buckets of the
        per-process limiter that decides without Redis (injectable for tests).

    Raises:
      ValueError: `url` is not a Redis URL, or `lease_ttl_s` is not positive.
    """

    blocking = True  # every decision is a round trip (up to socket_timeout_s): called from worker threads

    def __init__(self, url: str, *, prefix: str = KEY_PREFIX, lease_ttl_s: float = LEASE_TTL_S,
                 socket_timeout_s: float = SOCKET_TIMEOUT_S, redis_retry_s: float = REDIS_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s!r}")
        self.redis = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        kw = self.redis.connection_pool.connection_kwargs
        self.where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}/{kw.get('db', 0)}"  # no password
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self.redis_retry_s = redis_retry_s
        self.clock = clock
        self.fallback = RateLimiter(clock)
        self._admit = self.redis.register_script(_ADMIT_LUA)
        self._settle_lease = self.redis.register_script(_SETTLE_LUA)
        self._renew = self.redis.register_script(_RENEW_LUA)
        self._levels = self.redis.register_script(_LEVELS_LUA)
        self._lock = threading.Lock()
        self._held: weakref.WeakValueDictionary[str, Admission] = weakref.WeakValueDictionary()
        self._retry_at = -float("inf")
        self._stop = threading.Event()
        try:
            self.redis.ping()
        except RedisError as e:
            log.warning("Redis at %s is not answering (%s): each gateway keeps its own rate limits "
                        "until it does", self.where, e)
        self._renewer: threading.Thread | None = None  # started by the first lease

    # -- decisions ---------------------------------------------------------------

    def admit(self, principal: Principal, tokens: int) -> Admission:
        """Takes one request, `tokens` tokens and a concurrency lease from every applicable limit.

        Decided in Redis; by this gateway's own limiter when Redis does not answer.

        Raises:
          RateLimited: some limit has no room (nothing is taken then).
        """
        scopes = self._scopes_of(principal)
        if not scopes:
            return Admission(tokens, [], {}, self, [])
        if self.clock() < self._retry_at:
            return self._admit_here(principal, tokens)
        lease = _Lease(secrets.token_hex(8), tuple(scopes))
        keys, args = [], [tokens, lease.lease_id, int(self.lease_ttl_s * 1000)]
        for s in scopes:
            keys += [s.requests, s.tokens, s.leases]
            args += [s.limits.rpm or 0, s.limits.tpm or 0, s.limits.max_concurrent or 0]
        try:
            admitted, *found = self._admit(keys=keys, args=args)
        except RedisError as e:
            self._unreachable("an admission", e)
            return self._admit_here(principal, tokens)
        states = [(s.kind, ScopeState(s.limits, _bucket(s.limits.rpm, found[3 * i]),
                                      _bucket(s.limits.tpm, found[3 * i + 1]), int(found[3 * i + 2])))
                  for i, s in enumerate(scopes)]
        if not admitted:
            exceeded = first_exceeded(states, tokens)
            if exceeded is None:  # the script and first_exceeded disagree: a bug, not a limit
                raise RuntimeError(f"Redis refused a request that fits every limit: {states}")
            raise exceeded
        adm = Admission(tokens, [decision_of(kind, st) for kind, st in states],
                        rate_limit_headers(states), self, [lease])
        with self._lock:
            self._held[lease.lease_id] = adm
            if self._renewer is None and not self._stop.is_set():
                self._renewer = threading.Thread(target=self._renew_loop, name="xlaserve-lease-renewal",
                                                 daemon=True)
                self._renewer.start()
        return adm

    def headers(self, principal: Principal) -> dict[str, str]:
        """The current ``x-ratelimit-*`` headers of `principal` (empty when unlimited).

        From Redis; from this gateway's own limiter when Redis does not answer.
        """
        scopes = self._scopes_of(principal)
        if not scopes:
            return {}
        if self.clock() < self._retry_at:
            return self.fallback.headers(principal)
        keys, args = [], []
        for s in scopes:
            keys += [s.requests, s.tokens]
            args += [s.limits.rpm or 0, s.limits.tpm or 0]
        try:
            found = self._levels(keys=keys, args=args)
        except RedisError as e:
            self._unreachable("reading rate-limit headers", e)
            return self.fallback.headers(principal)
        return rate_limit_headers([
            (s.kind, ScopeState(s.limits, _bucket(s.limits.rpm, found[2 * i]),
                                _bucket(s.limits.tpm, found[2 * i + 1])))
            for i, s in enumerate(scopes)])

    def _settle(self, adm: Admission, used: int) -> None:
        if not adm._scopes:
            return
        lease: _Lease = adm._scopes[0]
        with self._lock:
            self._held.pop(lease.lease_id, None)
        keys, args = [], [lease.lease_id, adm.reserved_tokens - used]
        for s in lease.scopes:
            keys += [s.tokens, s.leases]
            args.append(s.limits.tpm or 0)
        try:
            self._settle_lease(keys=keys, args=args)
        except RedisError as e:  # always tried: a lapsed lease would hold its slot for the TTL
            log.warning("Redis at %s did not settle lease %s (%s): its slot comes back within %.0f s, "
                        "its %d unused tokens do not", self.where, lease.lease_id, e, self.lease_ttl_s,
                        max(0, adm.reserved_tokens - used))

    # -- leases ------------------------------------------------------------------

    def renew_leases(self) -> int:
        """Renews the lease of every unsettled admission of this gateway for another TTL.

        Called every third of the TTL by a background thread. Returns how many
        leases were still held (a lapsed one is not renewed: its slot may be
        someone else's by now). Stops at the first Redis error (logged).
        """
        with self._lock:
            held = list(self._held.values())
        renewed = 0
        for adm in held:
            lease: _Lease = adm._scopes[0]
            try:
                renewed += self._renew(keys=[s.leases for s in lease.scopes],
                                       args=[lease.lease_id, int(self.lease_ttl_s * 1000)])
            except RedisError as e:
                log.warning("Redis at %s did not renew %d leases (%s): they lapse %.0f s after "
                            "their last renewal", self.where, len(held), e, self.lease_ttl_s)
                break
        return renewed

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_ttl_s / 3):
            try:
                self.renew_leases()
            except Exception:  # keep renewing whatever happened
                log.exception("renewing rate-limit leases failed")

    def close(self) -> None:
        """Stops renewing leases and closes the connections. Unsettled leases lapse by their TTL."""
        with self._lock:
            self._stop.set()
            renewer = self._renewer
        if renewer is not None:
            renewer.join(timeout=5)
        self.redis.close()

    # -- helpers -----------------------------------------------------------------

    def _scopes_of(self, p: Principal) -> list[_ScopeKeys]:
        out = []
        tag = f"{self.prefix}{{{p.tenant}}}"
        if p.key_id is not None and p.key_limits != Limits():
            out.append(self._keys("key", f"{tag}:key:{p.key_id}", p.key_limits))
        if p.tenant_limits != Limits():
            out.append(self._keys("tenant", f"{tag}:tenant", p.tenant_limits))
        return out

    @staticmethod
    def _keys(kind: str, base: str, limits: Limits) -> _ScopeKeys:
        return _ScopeKeys(kind, limits, f"{base}:requests", f"{base}:tokens", f"{base}:leases")

    def _admit_here(self, principal: Principal, tokens: int) -> Admission:
        """Decides on this gateway's own limiter (Redis unreachable); its trace decisions say so."""
        adm = self.fallback.admit(principal, tokens)
        adm.decisions = [{**d, "note": FALLBACK_NOTE} for d in adm.decisions]
        return adm

    def _unreachable(self, what: str, e: RedisError) -> None:
        self._retry_at = self.clock() + self.redis_retry_s
        log.warning("Redis at %s failed %s (%r): rate limits are this gateway's own; "
                    "Redis is tried again in %.0f s", self.where, what, e, self.redis_retry_s)


def _bucket(capacity: int | None, level: str) -> TokenBucket | None:
    """A bucket of `capacity` at a level Redis reported (None: no such limit)."""
    if not capacity:
        return None
    b = TokenBucket(capacity, 0.0)
    b.level = float(level)
    return b
