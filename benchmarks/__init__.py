"""Benchmarks (run as modules: ``python -m benchmarks.NAME``; some as ``xlaserve bench``, through
an entry point, so that nothing of ``serving`` imports this package).

May import: *.
"""
