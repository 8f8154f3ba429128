"""The gateway's services beside the models (``GatewayServices``): metering (a ledger row, metrics,
spans and a trace per admitted request), Prometheus metrics, OpenTelemetry spans, content
policies, prefix-cache scopes and service tiers (``service_tiers.py``: the tier served, allow-lists,
flex shedding).

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.accounts.
"""
