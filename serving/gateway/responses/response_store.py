"""Stored responses of the Responses API (``store: true``), per tenant.

Each row (``database.responses``) keeps the response object, for ``GET
/v1/responses/{id}``, and the conversation up to and including it as chat
messages (``history``), which a request naming it as ``previous_response_id``
continues. A tenant sees only its own responses: another tenant's id is
answered as one that does not exist (404, or 400 for
``previous_response_id``), so ids leak nothing. Rows live in the gateway
database, so every gateway sharing it can continue any response.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from serving.gateway.accounts.database import responses as responses_table
from serving.gateway.http.errors import OpenAIError


def response_not_found(response_id: str) -> OpenAIError:
    """404 for a response that does not exist, was not stored, or is another tenant's."""
    return OpenAIError(f"Response with id '{response_id}' not found.", status_code=404,
                       param="response_id", code="response_not_found")


def previous_response_not_found(response_id: str) -> OpenAIError:
    """400 for a ``previous_response_id`` that names no stored response of the caller's."""
    return OpenAIError(f"Previous response with id '{response_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")


class ResponseStore:
    """Responses in the gateway database. Every method blocks on it (call from a
    worker thread).

    Args:
      engine: a SQLAlchemy engine (tables created; see ``database.py``).
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def save(self, tenant: str, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Stores (or replaces) `response` (its ``id``, ``model``, ``created_at``,
        ``previous_response_id``) and the conversation's messages `history`."""
        row = dict(response_id=response["id"], tenant=tenant, model=response["model"],
                   created_at=float(response["created_at"]),
                   previous_response_id=response.get("previous_response_id"),
                   response=json.dumps(response), history=json.dumps(history))
        with self.engine.begin() as conn:
            conn.execute(responses_table.delete().where(responses_table.c.response_id == row["response_id"]))
            conn.execute(responses_table.insert().values(**row))

    def _json(self, column: str, response_id: str, tenant: str) -> Any:
        with self.engine.connect() as conn:
            text = conn.execute(sa.select(responses_table.c[column]).where(
                responses_table.c.response_id == response_id, responses_table.c.tenant == tenant)).scalar()
        return None if text is None else json.loads(text)

    def get(self, response_id: str, tenant: str) -> dict[str, Any] | None:
        """`tenant`'s stored response object, or None."""
        return self._json("response", response_id, tenant)

    def history(self, response_id: str, tenant: str) -> list[dict[str, Any]] | None:
        """The chat messages that `tenant`'s response `response_id` ends, or None."""
        return self._json("history", response_id, tenant)

    def delete(self, response_id: str, tenant: str) -> bool:
        """Deletes `tenant`'s response; False when there was none."""
        with self.engine.begin() as conn:
            n = conn.execute(responses_table.delete().where(
                responses_table.c.response_id == response_id, responses_table.c.tenant == tenant)).rowcount
        return n > 0
