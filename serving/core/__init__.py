"""Host-side planning, no JAX: the scheduler and its step plan (``sched``), the KV-cache pages
and their prefix-cache hashes (``kv``), and structured output's grammars and matchers on the
host (``structured_output``, with llguidance).

May import: serving.contract, serving.config.
"""
