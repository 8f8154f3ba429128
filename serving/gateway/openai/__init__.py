"""OpenAI's completions and chat completions, and vLLM's tokenizer routes: the handlers, the
served models, prompts to token ids, choices, sampling settings, the metered generation, the
chat run with its reasoning and tool calls, log probabilities, and the shared response pieces.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.accounts, serving.gateway.services, serving.gateway.tools,
serving.gateway.tools.tool_parsers, serving.gateway.schema, serving.gateway.media.
"""
