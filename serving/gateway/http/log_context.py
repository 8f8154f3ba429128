"""The current request's X-Request-ID in every log line.

The gateway's middleware sets :data:`request_id_var` for the request's task
(and the tasks it spawns); :class:`RequestIdLogFilter` copies it onto each log
record as ``record.request_id`` ("-" outside a request), for a format such as
``"%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"``.
"""

from __future__ import annotations

import contextvars
import logging

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("xlaserve_request_id", default="-")

LOG_FORMAT = "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"


class RequestIdLogFilter(logging.Filter):
    """Adds ``request_id`` to every record that passes through the handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True
