"""Which replica serves a request: the router behind one ``EngineClient`` (kv-aware, least-load,
round-robin, failover) and the two hops of disaggregated serving. No JAX, no HTTP.

May import: serving.contract, serving.core.kv, serving.rpc.
"""
