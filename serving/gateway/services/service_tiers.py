"""Service tiers: which tier a request is served at, who may ask for it, and when flex is shed.

A request's ``service_tier`` (OpenAI's field on chat completions, completions
and the Responses API) is one of ``auto``, ``default``, ``flex``, ``priority``;
``auto`` (or no field) is served as ``default``. The tier served is echoed in
the response, in every stream chunk, in the ledger row (``service_tier``) and in
the trace, and prices the request (``pricing.py``: a multiplier per tier).

Each tier runs in an engine scheduling class (``EngineRequest.priority``):

    tier        engine class   scheduler (serving.core.sched.scheduler)
    priority    "priority"     runs first; takes the slot of default and flex work
    default     "interactive"  takes the slot of flex work
    flex        "batch"        admitted last, preempted first, promoted once starved

The xlaserve extension ``priority: "batch"`` (what the Batch API's lines carry)
is flex-class work: it is served at tier ``flex`` (a ``service_tier`` of
``priority`` with it is a 400) but is never shed here, since the Batch API
bounds how many lines run at once.

Flex admission (:class:`FlexAdmission`): a ``flex`` request is admitted only
while the engine's load is below the operator's threshold: at most
``max_waiting`` requests waiting for a slot and at most ``max_kv_usage`` of
the KV cache in use (the engine's last reported stats). Above it the request
is shed: 429 with type and code ``resource_unavailable`` and ``Retry-After``,
recorded in the ledger with status ``shed`` and no tokens or cost.

Allow-lists: a tenant and a key may each carry a list of the tiers their
requests may ask for (``Principal.service_tiers``: both lists apply); asking
for another is a 403 ``service_tier_not_allowed`` (as a model the tenant may
not use is a 403 ``model_not_allowed``). ``auto`` resolves to ``default`` when
allowed, else to the first allowed tier of ``default``, ``flex``,
``priority``.
"""

from __future__ import annotations

import dataclasses

from serving.contract.engine_client import EngineStats
from serving.gateway.accounts.api_keys import Principal
from serving.gateway.http.errors import OpenAIError

SERVICE_TIERS = ("auto", "default", "flex", "priority")
"""What a request's ``service_tier`` may say."""

SERVED_TIERS = ("default", "flex", "priority")
"""The tiers a request is served at (``auto`` resolves to one of them)."""

ENGINE_PRIORITY = {"priority": "priority", "default": "interactive", "flex": "batch"}
"""The engine scheduling class (``EngineRequest.priority``) of each served tier."""

DEFAULT_FLEX_RETRY_AFTER_S = 1


@dataclasses.dataclass(frozen=True)
class FlexAdmission:
    """When ``flex`` requests are admitted (see the module docstring).

    Attributes:
      max_waiting: most requests waiting for an engine slot (``EngineStats.num_waiting``)
        with which a flex request is still admitted.
      max_kv_usage: most fraction of the KV cache in use (0..1) with which it is admitted.
      retry_after_s: the ``Retry-After`` seconds a shed request is told.

    Raises:
      ValueError: a negative ``max_waiting``, ``max_kv_usage`` outside [0, 1], or
        ``retry_after_s`` below 1.
    """

    max_waiting: int = 0
    max_kv_usage: float = 0.9
    retry_after_s: int = DEFAULT_FLEX_RETRY_AFTER_S

    def __post_init__(self) -> None:
        if self.max_waiting < 0 or not 0.0 <= self.max_kv_usage <= 1.0 or self.retry_after_s < 1:
            raise ValueError(f"bad flex admission settings: {self}")

    def overload(self, stats: EngineStats) -> str | None:
        """Why a flex request is shed under load `stats` (a sentence), or None to admit it."""
        if stats.num_waiting > self.max_waiting:
            return f"{stats.num_waiting} requests wait for a slot (flex is admitted at {self.max_waiting} or fewer)"
        if stats.kv_cache_usage > self.max_kv_usage:
            return (f"{stats.kv_cache_usage:.0%} of the KV cache is in use (flex is admitted at "
                    f"{self.max_kv_usage:.0%} or less)")
        return None


def served_tier(requested: str | None, priority: str, principal: Principal) -> str:
    """The tier a request is served at.

    Args:
      requested: the request's ``service_tier`` (None: not given, as ``auto``).
      priority: the request's ``priority`` extension ("interactive" or "batch").
      principal: the caller (its tier allow-list).

    Raises:
      OpenAIError: 400 for ``priority`` with ``priority: "batch"``; 403
        ``service_tier_not_allowed`` for a tier the caller's key or tenant may not use.
    """
    tier = requested or "auto"
    if priority == "batch":
        if tier == "priority":
            raise OpenAIError("'service_tier' 'priority' cannot be combined with 'priority': 'batch' "
                              "(batch work is served at the flex tier).", param="service_tier")
        tier = "flex"
    allowed = principal.service_tiers
    if tier == "auto":
        if allowed is None or "default" in allowed:
            return "default"
        tier = next((t for t in SERVED_TIERS if t in allowed), "default")
    if allowed is not None and tier not in allowed:
        raise OpenAIError(
            f"Your API key may not use service_tier '{tier}' (allowed: {', '.join(sorted(allowed)) or 'none'}).",
            status_code=403, param="service_tier", code="service_tier_not_allowed")
    return tier


def flex_shed(reason: str, retry_after_s: int) -> OpenAIError:
    """429 ``resource_unavailable`` for a flex request shed under load, with ``Retry-After``."""
    return OpenAIError(f"Flex capacity is unavailable right now: {reason}. Retry later, or use "
                       "service_tier 'default'.", status_code=429, type="resource_unavailable",
                       code="resource_unavailable", param="service_tier",
                       headers={"Retry-After": str(retry_after_s)})
