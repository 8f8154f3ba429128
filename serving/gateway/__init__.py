"""The OpenAI-compatible HTTP gateway (no JAX): ``app.py`` builds the FastAPI app from the
packages below it, lowest first: ``http`` (errors, SSE, limits), ``accounts`` (keys, rate
limits, the ledger), ``services``, ``tools``, ``schema`` (the API's models), ``openai``
(completions, chat, tokenizer routes), ``responses`` and ``batch``.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.*.
"""
