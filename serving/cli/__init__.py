"""The ``xlaserve`` command, one module a subcommand (``serve``, ``engine``, ``generate``,
``convert``, ``shard-plan``; ``admin``: keys, tenants, usage), the flags they share, and the
engine bootstrap. The top: nothing of ours imports it.

May import: model, sharding, serving.*.
"""
