"""Benchmarks (run as modules: python -m benchmarks.NAME)."""
