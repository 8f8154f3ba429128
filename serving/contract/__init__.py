"""The interfaces between the gateway and an engine: ``EngineClient`` (submit a request, a
stream of token events back, cancel, stats) with its request, event and error types, and what
the gateway needs of a tokenizer. No JAX, no third-party imports beyond the standard library.

May import: nothing of ours.
"""
