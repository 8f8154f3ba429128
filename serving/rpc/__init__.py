"""The engine service's wire: ``engine.proto`` and its generated modules, conversions between the
engine client's dataclasses and the messages, and the gateway's client of one remote replica.
No JAX: the gateway imports it.

May import: serving.contract.
"""
