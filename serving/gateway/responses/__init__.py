"""OpenAI's Responses API: its request model, its output items and streamed events, its routes,
and stored responses.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.accounts, serving.gateway.tools, serving.gateway.schema, serving.gateway.openai,
serving.gateway.media.
"""
