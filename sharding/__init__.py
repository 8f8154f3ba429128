"""The device mesh, logical-axis rules, placement of parameters and KV cache, ``shard-plan``'s
arithmetic, and multi-host start-up and lockstep steps.

May import: model, kernels_pallas.
"""
