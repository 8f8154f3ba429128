"""The scheduler: which requests run each step within a token budget, preemption, the step plan
it hands the engine (plain value records), the flex starvation guard, and speculative decoding's
n-gram proposer. No JAX.

May import: serving.config, serving.core.kv.
"""
