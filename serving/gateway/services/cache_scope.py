"""Prefix-cache scopes: which callers may share cached prompt pages.

The engine shares prefix-cache pages only between requests with the same
``EngineRequest.cache_salt``, an opaque string to it. The gateway composes
that salt from the caller's *scope* and the request's own ``cache_salt`` field
(vLLM's extension), so a tenant's cached prefixes serve only that tenant: one
tenant cannot learn from another's time-to-first-token (or
``cached_tokens``) whether it sent a given prompt prefix.

A tenant's scope is the tenant itself, unless the operator put it in a group
(``prefix_cache_groups: {group: [tenant, ...]}`` in the server config, or
``--prefix-cache-group GROUP=TENANT,TENANT``): the tenants of a group share one
scope. With no API keys every caller is the tenant ``anonymous``, so everyone
shares.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence


class PrefixCacheScopes:
    """Maps (tenant, request ``cache_salt``) to the engine's prefix-cache salt.

    Args:
      groups: group name -> the tenants that share one prefix-cache scope.

    Raises:
      ValueError: a tenant in two groups, or names that are not strings.
    """

    def __init__(self, groups: Mapping[str, Sequence[str]] | None = None) -> None:
        self._group_of: dict[str, str] = {}
        for group, tenants in (groups or {}).items():
            if not isinstance(group, str) or isinstance(tenants, str) or not all(
                    isinstance(t, str) for t in tenants):
                raise ValueError(f"prefix_cache_groups: group {group!r} must name a list of tenants, "
                                 f"got {tenants!r}")
            for tenant in tenants:
                other = self._group_of.setdefault(tenant, group)
                if other != group:
                    raise ValueError(f"prefix_cache_groups: tenant {tenant!r} is in two groups "
                                     f"({other!r} and {group!r})")

    def scope(self, tenant: str) -> tuple[str, str]:
        """The caller's scope: ``("group", name)`` for a grouped tenant, else ``("tenant", tenant)``."""
        group = self._group_of.get(tenant)
        return ("group", group) if group is not None else ("tenant", tenant)

    def salt(self, tenant: str, cache_salt: str | None) -> str:
        """The engine's salt for a request of `tenant` with the optional client `cache_salt`:
        a SHA-256 hex digest of the scope and the client's salt (64 characters)."""
        key = json.dumps([*self.scope(tenant), cache_salt], ensure_ascii=False)
        return hashlib.sha256(key.encode()).hexdigest()
