"""An engine replica's side of the wire: the gRPC engine service over an engine loop, who may
call it (TLS, client certificates, the shared token), the KV
connector (prefill/decode disaggregation on the engine loop's side) and the KV transports.

May import: model, serving.contract, serving.config, serving.core.kv, serving.engine,
serving.runtime, serving.rpc.
"""
