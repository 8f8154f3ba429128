"""The output pipeline: one engine request's token events in, text deltas out (incremental
UTF-8-safe detokenization, stop strings, the output policy's filter, cancel on stop), shared by
the gateway and ``xlaserve generate``. No JAX.

May import: serving.contract.
"""
