"""The engine loop behind ``EngineClient``: it runs the scheduler's plans on the engine, in its
own thread, with pipelined steps; a request's checks and row settings; the loop's side of the
host KV tier, speculative decoding and structured output.

May import: serving.contract, serving.config, serving.core, serving.core.sched, serving.core.kv,
serving.engine, serving.engine.sample.
"""
