"""The gateway's services beside the models (``GatewayServices``): metering (a ledger row, metrics,
spans and a trace per admitted request), Prometheus metrics, OpenTelemetry spans, content
policies and prefix-cache scopes.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.accounts.
"""
