"""The HTTP layer under every route: OpenAI-shaped errors and their handlers, the body-size limit,
server-sent events, client disconnects, per-request scope values, the request id in log lines,
the gateway's limits, and the OpenAPI description.

May import: serving.contract.
"""
