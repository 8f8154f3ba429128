"""The gateway's services beside the models: auth, metering, policies.

:class:`GatewayServices` bundles what a request passes through on its way to
an engine. ``GatewayServices.open_server(...)`` builds the production set
(database, price table, limits, metrics, policies); the default-constructed
one runs open and records nothing, for in-process use and unit tests. Rate
limits are per process unless a Redis URL is given (``redis_rate_limit.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from serving.gateway.accounts.api_keys import KeyStore
from serving.gateway.accounts.auth import Authenticator
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.accounts.ledger_instances import DEFAULT_SPOOL_MAX_BYTES, GatewayInstance, release_instance
from serving.gateway.accounts.pricing import PriceTable, load_price_table
from serving.gateway.accounts.rate_limit import RateLimiter
from serving.gateway.services.cache_scope import PrefixCacheScopes
from serving.gateway.services.metering import Metering
from serving.gateway.services.metrics import GatewayMetrics
from serving.gateway.services.policy import Policies
from serving.gateway.services.service_tiers import FlexAdmission
from serving.gateway.services.tracing import RequestTracer


@dataclasses.dataclass
class GatewayServices:
    """Attributes:
      authenticator: resolves API keys to principals.
      metering: rate limits, ledger, metrics, spans.
      policies: content policy hooks.
      ledger: the request ledger (None: nothing recorded).
      log_text: whether logs may carry prompt and completion text.
      cache_scopes: which tenants share prefix-cache pages (default: each
        tenant only its own).
      instance: this gateway's instance (its id on ledger rows, its spool's
        directory), when it keeps a ledger.
      flex_admission: when ``service_tier`` "flex" requests are shed (``service_tiers.py``).
    """

    authenticator: Authenticator = dataclasses.field(default_factory=lambda: Authenticator(None))
    metering: Metering = dataclasses.field(default_factory=lambda: Metering(
        None, PriceTable(models={}), GatewayMetrics(), RateLimiter(), RequestTracer(False)))
    policies: Policies = dataclasses.field(default_factory=Policies)
    ledger: Ledger | None = None
    log_text: bool = False
    cache_scopes: PrefixCacheScopes = dataclasses.field(default_factory=PrefixCacheScopes)
    instance: GatewayInstance | None = None
    flex_admission: FlexAdmission = FlexAdmission()

    @classmethod
    def open_server(cls, database_url: str | None = None, prices_path: str | None = None,
                    blocklist: Sequence[str] = (), blocklist_applies_to: Sequence[str] = ("input", "output"),
                    policy_plugins: Sequence[str] = (), otel_traces: bool = False,
                    log_text: bool = False,
                    prefix_cache_groups: Mapping[str, Sequence[str]] | None = None,
                    redis_url: str | None = None, ledger_spool_dir: str | None = None,
                    ledger_spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES) -> "GatewayServices":
        """Opens the database (creating tables) and builds every service.

        Args:
          prefix_cache_groups: group name -> tenants that share prefix-cache
            pages (see ``cache_scope.py``); the rest share only within a tenant.
          redis_url: Redis that holds the rate limits shared by every gateway
            using it (None: ``$XLASERVE_REDIS_URL``, else limits per process).
          ledger_spool_dir, ledger_spool_max_bytes: where usage rows go while the
            database is unreachable, and its bound in bytes (``ledger_spool.py``);
            gone gateways' spools there are replayed and their running rows
            marked "interrupted" now (``ledger_instances.py``).

        Raises:
          ValueError: a bad price table, policy setting, prefix-cache group, Redis URL
            or spool bound.
          sqlalchemy.exc.SQLAlchemyError: the database cannot be opened.
          OSError: the spool directory cannot be created.
        """
        from serving.gateway.accounts.database import open_database
        from serving.gateway.accounts.ledger_instances import open_durable_ledger
        from serving.gateway.accounts.redis_rate_limit import RedisRateLimiter, default_redis_url

        cache_scopes = PrefixCacheScopes(prefix_cache_groups)  # before the database: fail fast
        db = open_database(database_url)
        ledger, instance = open_durable_ledger(db, ledger_spool_dir, ledger_spool_max_bytes)
        redis_url = redis_url or default_redis_url()
        limiter = RedisRateLimiter(redis_url) if redis_url else RateLimiter()
        metrics = GatewayMetrics()
        metrics.watch_ledger(ledger)
        metering = Metering(ledger, load_price_table(prices_path), metrics, limiter,
                            RequestTracer(otel_traces))
        return cls(authenticator=Authenticator(KeyStore(db)), metering=metering,
                   policies=Policies.from_config(blocklist, blocklist_applies_to, policy_plugins),
                   ledger=ledger, log_text=log_text, cache_scopes=cache_scopes, instance=instance)

    def close(self) -> None:
        """Stops the services: the ledger writes what is queued, this gateway's rows still
        running are marked "interrupted" and its instance directory goes (kept for the next
        start when its spool holds writes or the database is away: ``ledger_instances.py``)."""
        self.metering.limiter.close()
        if self.ledger is not None:
            self.ledger.close()
            if self.ledger.spool is not None:
                self.ledger.spool.close()
        if self.instance is not None:
            release_instance(self.instance, self.ledger)
