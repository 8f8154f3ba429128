"""Who may open the console: admin keys, through the API's own authenticator.

A request to a console route carries the key as the API takes it (``Authorization: Bearer KEY``
or ``x-api-key``) or, from a browser, in the cookie :data:`COOKIE` that ``POST /console/login``
sets once the key it is given authenticates as an admin (HttpOnly, ``SameSite=Strict``,
``Path=/console``; ``Secure`` over HTTPS). Every request is authenticated again with the same
:class:`~serving.gateway.accounts.auth.Authenticator` as ``/v1``, so a revoked key loses the console
at once. Errors: 401 ``invalid_api_key`` (no key or an unknown one), 401 ``api_key_revoked``, 403
``admin_key_required`` (a key that is not an admin's, or a server running open without keys).
Changes (keys, tenants) take JSON bodies only, which a cross-site form cannot send, on top of
the SameSite cookie.
"""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from serving.gateway.accounts.api_keys import Principal
from serving.gateway.accounts.auth import Authenticator, credentials
from serving.gateway.http.errors import OpenAIError

COOKIE = "xlaserve_console"
COOKIE_PATH = "/console"


class LoginRequest(BaseModel):
    """``POST /console/login``'s body."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(min_length=1, max_length=512, description="An admin API key.")


def admin_required() -> OpenAIError:
    return OpenAIError("The console needs an admin API key ('xlaserve keys create --tenant NAME --admin').",
                       status_code=403, code="admin_key_required")


class ConsoleAuth:
    """Resolves a console request to an admin :class:`Principal`.

    Args:
      authenticator: the API's authenticator (the same keys, the same rules).
    """

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def admin_of(self, authorization: str | None) -> Principal:
        """The admin behind an ``Authorization`` value.

        Raises:
          OpenAIError: 401, 403 or 503 as :meth:`Authenticator.authenticate`; 403
            ``admin_key_required`` for a key that is not an admin's.
        """
        principal = await self.authenticator.authenticate(authorization)
        if not principal.is_admin:
            raise admin_required()
        return principal

    async def __call__(self, request: Request) -> Principal:
        """A FastAPI dependency: the request's admin (header first, then the cookie).

        Raises:
          OpenAIError: as :meth:`admin_of`.
        """
        auth = credentials(request.headers.get("authorization"), request.headers.get("x-api-key"))
        if auth is None and request.cookies.get(COOKIE):
            auth = f"Bearer {request.cookies[COOKIE]}"
        return await self.admin_of(auth)

    async def login(self, request: Request, body: LoginRequest) -> Response:
        """Checks `body.key` and sets the console cookie to it.

        Raises:
          OpenAIError: as :meth:`admin_of`.
        """
        principal = await self.admin_of(f"Bearer {body.key.strip()}")
        response = JSONResponse({"object": "console.session", "key_id": principal.key_id,
                                 "tenant": principal.tenant})
        response.set_cookie(COOKIE, body.key.strip(), path=COOKIE_PATH, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    @staticmethod
    def logout() -> Response:
        """Clears the console cookie (no key needed)."""
        response = JSONResponse({"object": "console.session", "deleted": True})
        response.delete_cookie(COOKIE, path=COOKIE_PATH)
        return response
