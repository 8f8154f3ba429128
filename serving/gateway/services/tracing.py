"""Optional OpenTelemetry spans for each request: gateway, queue, prefill, decode.

When ``otel_traces`` is on, every metered request emits, at its end, a
``gateway`` span (arrival to end) with three children laid on the engine's
own timestamps: ``queue`` (arrival to first prefill step), ``prefill`` (first
prefill step to first token) and ``decode`` (first token to end). Spans go to
the global tracer provider (opentelemetry-api), so exporting is configured the
standard way, e.g. ``opentelemetry-instrument xlaserve serve`` with the
``OTEL_*`` environment variables, or a provider set up in-process. Without
opentelemetry installed, or with the setting off, nothing happens.
"""

from __future__ import annotations

import logging
from typing import Mapping

log = logging.getLogger("xlaserve.gateway")


def _ns(t: float) -> int:
    return int(t * 1e9)


class RequestTracer:
    """Emits a request's spans from its recorded timestamps (Unix seconds).

    Args:
      enabled: whether to emit any.
      tracer_provider: where spans go (default: the global tracer provider).
    """

    def __init__(self, enabled: bool, tracer_provider=None) -> None:
        self._tracer = None
        if enabled:
            try:
                from opentelemetry import trace
            except ImportError:
                log.warning("otel_traces is on but opentelemetry-api is not installed; no spans")
                return
            self._trace = trace
            self._tracer = trace.get_tracer("xlaserve.gateway", tracer_provider=tracer_provider)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def emit(self, arrival: float, scheduled: float | None, first_token: float | None, end: float,
             attributes: Mapping[str, object]) -> None:
        """One request's spans. None-valued attributes are dropped."""
        if self._tracer is None:
            return
        attrs = {k: v for k, v in attributes.items() if v is not None}
        root = self._tracer.start_span("gateway", start_time=_ns(arrival), attributes=attrs)
        ctx = self._trace.set_span_in_context(root)
        phases = [("queue", arrival, scheduled or end)]
        if scheduled is not None:
            phases.append(("prefill", scheduled, first_token or end))
        if first_token is not None:
            phases.append(("decode", first_token, end))
        for name, t0, t1 in phases:
            span = self._tracer.start_span(name, context=ctx, start_time=_ns(t0))
            span.end(end_time=_ns(max(t0, t1)))
        root.end(end_time=_ns(end))
