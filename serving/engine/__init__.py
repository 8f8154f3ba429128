"""The device side: the engine's state and its jitted prefill, decode and verify steps, their
typed batches, the backend policy (every platform-specific choice, made once), whole KV pages in
and out of the device cache, and the persistent compilation cache. Sampling is ``sample``.

May import: model, kernels_pallas, kernels_cpu, sharding, serving.contract, serving.config, serving.core.sched,
serving.core.kv, serving.engine.sample.
"""
