"""Per-request values the gateway keeps in the ASGI scope.

``RequestIdMiddleware`` (``app.py``) writes the request id; handlers and the
auth dependency write the rate-limit headers, which the middleware then adds
to the response. Both sides import the keys from here.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request

REQUEST_ID_SCOPE_KEY = "xlaserve.request_id"
"""The request's X-Request-ID value (str)."""

REQUEST_ID_GIVEN_SCOPE_KEY = "xlaserve.request_id_given"
"""True when the client sent that X-Request-ID (bool)."""

RATE_LIMIT_HEADERS_SCOPE_KEY = "xlaserve.ratelimit_headers"
"""The ``x-ratelimit-*`` headers for the response (dict[str, str])."""


def request_id_of(request: Request) -> tuple[str, bool]:
    """(X-Request-ID value, whether the client sent it) for `request`; a fresh
    uuid hex when the middleware did not run."""
    rid = request.scope.get(REQUEST_ID_SCOPE_KEY) or uuid.uuid4().hex
    return rid, bool(request.scope.get(REQUEST_ID_GIVEN_SCOPE_KEY))
