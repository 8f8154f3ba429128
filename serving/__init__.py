"""xlaserve's serving side: everything between an HTTP request and the model's step functions.

One package a layer, lowest first: ``contract`` and ``config``; ``output``; ``core`` (host
planning, no JAX); ``engine`` and ``loading`` (the device); ``runtime`` (the engine loop);
``rpc``, ``replica`` and ``routing`` (engines in other processes); ``gateway`` (HTTP, no JAX);
``cli`` (the commands). docs/design/architecture.md draws the layers and the request's path;
tests/test_module_boundaries.py holds each package's ``May import`` line.

May import: nothing of ours.
"""
