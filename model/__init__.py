"""Model definitions, weight loading and the tokenizer.

Import submodules directly (``model.gemma3``, ``model.tokenizer``); this package
init stays empty so that tokenizer users never import JAX.

May import: kernels_pallas.
"""
