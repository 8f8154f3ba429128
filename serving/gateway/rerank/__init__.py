"""Rerank and score: ``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``; Jina's and Cohere's
form) and ``POST /v1/score`` (and ``/score``; vLLM's), their request and response models, on a
model served with ``--task rerank``.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.accounts, serving.gateway.services, serving.gateway.schema, serving.gateway.openai.
"""
