"""The engine service's wire: ``engine.proto`` and its generated modules, conversions between the
engine client's dataclasses and the messages, the gateway's client of one remote replica, and how
clients open channels to an engine port (TLS, client certificates, the shared token).
No JAX: the gateway imports it.

May import: serving.contract.
"""
