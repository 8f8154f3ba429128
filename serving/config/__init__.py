"""Settings: ``configs/server.yaml`` with command-line overrides (``ServerConfig``, the data and
cache directories), the engine's static sizes and shape buckets, speculative decoding's
settings, and reading the YAML files of ``configs/``. No JAX.

May import: nothing of ours.
"""
