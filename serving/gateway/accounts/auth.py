"""Bearer-token authentication of ``/v1`` routes.

* Keys configured (any key in the database, revoked ones included): ``Authorization: Bearer
  KEY`` is required (or, Anthropic's form, ``x-api-key: KEY``; Authorization wins when both
  are sent); a missing or unknown key is 401 ``invalid_api_key``, a
  revoked key 401 ``api_key_revoked`` (as OpenAI's API answers a revoked key: the credential
  no longer authenticates; 403 is for a valid key refused something).
* No keys configured: the server runs open and every caller is the
  ``anonymous`` tenant, never an admin (whatever Authorization header it sends, so
  clients that always send one, like the openai package, work). ``xlaserve serve``
  allows that only on a loopback address, or with ``--allow-unauthenticated``; the
  rule holds at run time too (``require_keys``): a non-loopback gateway whose keys
  are all deleted while it runs answers 503 ``no_api_keys`` rather than run open.

Database look-ups run in a worker thread, never on the event loop. A key found
active is remembered for ``KEY_CACHE_S`` (one second): its requests in that second
skip the query (a tenant sending hundreds of requests a second, refused or not,
would otherwise cost a query and a worker thread each). A key revoked or a tenant's
limits changed through this process's :class:`KeyStore` (the console) apply at
once; through another process (``xlaserve keys revoke``, another
gateway) within ``KEY_CACHE_S``. Revoked and unknown keys are never remembered: a
key created anywhere works at once. While the
database is unreachable, a key answers as it did at its last successful look-up
(a key revoked during the outage is refused once the database is back); a key
not looked up since the gateway started gets 503 ``database_unavailable``.
"""

from __future__ import annotations

import time

import anyio

from serving.gateway.accounts.api_keys import ANONYMOUS, KeyStore, Principal, hash_key
from serving.gateway.accounts.database import is_unreachable
from serving.gateway.http.errors import SERVER_ERROR, OpenAIError

_HAS_KEYS_TTL_S = 1.0
KEY_CACHE_S = 1.0
"""Seconds a key found active answers without a database query (a revocation made by
another process applies within it)."""
_KEY_CACHE_MAX = 65536


def database_unavailable() -> OpenAIError:
    return OpenAIError("The key database is unreachable and this key has not been seen since the "
                       "server started; try again later.", status_code=503, type=SERVER_ERROR,
                       code="database_unavailable", headers={"Retry-After": "5"})


def no_api_keys() -> OpenAIError:
    return OpenAIError("This server serves only callers with an API key and none is configured now; "
                       "an operator must create one ('xlaserve keys create --tenant NAME').",
                       status_code=503, type=SERVER_ERROR, code="no_api_keys")


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(message, status_code=401, code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def credentials(authorization: str | None, api_key: str | None) -> str | None:
    """The ``Authorization`` value to authenticate: the header, or else ``Bearer <x-api-key>``
    (Anthropic's header), or None when neither was sent."""
    if authorization:
        return authorization
    return f"Bearer {api_key.strip()}" if api_key and api_key.strip() else None


class Authenticator:
    """Resolves a request's Authorization header to a :class:`Principal`.

    Args:
      key_store: the keys (None: always open, for in-process use and tests).
      require_keys: never run open: while no key exists, every caller gets 503
        ``no_api_keys`` (``xlaserve serve`` sets it on a non-loopback address without
        ``--allow-unauthenticated``).
    """

    def __init__(self, key_store: KeyStore | None, require_keys: bool = False) -> None:
        self.key_store = key_store
        self.require_keys = require_keys
        self._has_keys: tuple[float, bool | None] = (-1e9, None)
        # sha256 of a key -> its last look-up that found it ("ok" or "revoked"), for outages.
        self._known: dict[str, tuple[str, Principal | None]] = {}
        # sha256 of a key found active -> (until, on the monotonic clock; the key store's
        # generation when it was looked up; its principal)
        self._recent: dict[str, tuple[float, int, Principal]] = {}

    async def _keys_configured(self) -> bool:
        t, value = self._has_keys
        now = time.monotonic()
        if now - t > _HAS_KEYS_TTL_S:
            try:
                value = await anyio.to_thread.run_sync(self.key_store.has_keys)
            except Exception as e:
                if not is_unreachable(e) or value is None:
                    raise database_unavailable() if is_unreachable(e) else e
                return value  # the last answer, until the database is back
            self._has_keys = (now, value)
        return value

    async def _lookup(self, token: str) -> tuple[str, Principal | None]:
        digest = hash_key(token)
        generation = self.key_store.generation
        recent = self._recent.get(digest)
        if recent is not None:
            until, seen_at, principal = recent
            if seen_at == generation and time.monotonic() < until:
                return "ok", principal
            del self._recent[digest]
        try:
            status, principal = await anyio.to_thread.run_sync(self.key_store.lookup, token)
        except Exception as e:
            if not is_unreachable(e):
                raise
            if digest not in self._known:
                raise database_unavailable() from None
            return self._known[digest]
        if status != "unknown":
            self._known[digest] = (status, principal)
        else:
            self._known.pop(digest, None)
        if status == "ok" and principal is not None:
            if len(self._recent) >= _KEY_CACHE_MAX:
                now = time.monotonic()
                self._recent = {d: r for d, r in self._recent.items() if r[0] > now}
            if len(self._recent) < _KEY_CACHE_MAX:  # else: more active keys in a second than it holds
                self._recent[digest] = (time.monotonic() + KEY_CACHE_S, generation, principal)
        return status, principal

    async def authenticate(self, authorization: str | None) -> Principal:
        """The caller for an ``Authorization`` header value (or None; see :func:`credentials`
        for ``x-api-key``).

        Raises:
          OpenAIError: 401 (missing, malformed, unknown or revoked key), 503
            ``no_api_keys`` (no key exists and ``require_keys``), 503 ``database_unavailable``.
        """
        if self.key_store is None or not await self._keys_configured():
            if self.require_keys:
                raise no_api_keys()
            return ANONYMOUS
        if not authorization:
            raise unauthorized("You didn't provide an API key. Send it in an Authorization header "
                               "as 'Authorization: Bearer YOUR_KEY' (or as 'x-api-key: YOUR_KEY').")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized("The Authorization header must be 'Bearer YOUR_KEY'.")
        status, principal = await self._lookup(token)
        if status == "revoked":
            raise OpenAIError("This API key has been revoked.", status_code=401, code="api_key_revoked")
        if principal is None:
            raise unauthorized(f"Incorrect API key provided: {token[:10]}…. Create one with "
                               "'xlaserve keys create --tenant NAME'.")
        return principal
