"""Anthropic's Messages API: its request model, its content blocks and streamed events,
its routes and its error shape.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.accounts, serving.gateway.tools, serving.gateway.schema, serving.gateway.openai,
serving.gateway.media.
"""
