"""A deadline on reading a request's headers: uvicorn's h11 protocol with a header read timeout.

uvicorn (0.29 to 0.55) times out only an idle keep-alive connection after a
response; a connection that never finishes its request line and headers (a
slowloris client: one byte every few seconds, or none) is held for ever, and a
thousand of them hold a thousand sockets and, with ``limit_concurrency``, every
slot. :func:`header_timeout_protocol` returns uvicorn's ``H11Protocol`` with a
deadline: from the connection's start, and again from the end of each
response, the next request's headers must be complete within ``timeout_s``
seconds (a total, not a per-read, deadline), or the connection is closed
without an answer. The body is not under it (``body_limit.py`` and the
handlers bound that).

Use: ``uvicorn.run(app, http=header_timeout_protocol(10.0), ...)``.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("xlaserve.gateway")


class _HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol closing a connection whose next request's headers are late."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._armed_cycle = self.cycle  # a request whose headers arrive starts another cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.cycle is self._armed_cycle and not self.transport.is_closing():
            log.info("closed a connection from %s: no complete request headers within %.1f s",
                     self.client, self.header_timeout_s)
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._armed_cycle:
            self._disarm()  # the headers came in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._arm()  # the next request on this connection gets a deadline of its own

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a header read deadline of `timeout_s` seconds.

    Raises:
      ValueError: `timeout_s` is not positive.
    """
    if not timeout_s > 0:
        raise ValueError(f"the header read timeout must be > 0 seconds, got {timeout_s!r}")
    return type("HeaderDeadlineH11Protocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": float(timeout_s)})
