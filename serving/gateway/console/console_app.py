"""The console on the gateway's app: its admin check, pages and JSON routes in one call."""

from __future__ import annotations

from typing import Callable, Mapping

from fastapi import FastAPI

from serving.gateway.accounts.auth import Authenticator
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.console.console_api import install_console_api
from serving.gateway.console.console_auth import ConsoleAuth
from serving.gateway.console.console_pages import install_console_pages


def install_console(app: FastAPI, authenticator: Authenticator, ledger: Ledger | None, models: list[str],
                    engine_stats: Callable[[], Mapping[str, Callable[[], object] | None]],
                    trace_body: Callable[[dict], dict]) -> None:
    """Serves the console at ``/console`` on `app` (``console_pages.py``, ``console_api.py``).

    Args:
      authenticator: the API's authenticator (its ``key_store``, if it has one, holds the keys
        the console manages; without one the keys page has none to manage).
      ledger: the request ledger (None: the pages that read it show the 404 ``no_ledger``).
      models: the served models' names.
      engine_stats: () -> {model: its engine's ``stats`` callable or None}.
      trace_body: a ledger row -> the ``GET /v1/requests/{id}`` body.
    """
    auth = ConsoleAuth(authenticator)
    install_console_pages(app, auth, models)
    install_console_api(app, auth, ledger, getattr(authenticator, "key_store", None), engine_stats, trace_body)
