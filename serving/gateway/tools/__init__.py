"""Tool calling and reasoning in a model's text: the tool request models, forced tool calls, the
call formats' parsers (``tool_parsers``), ``<think>`` reasoning, and which parsers a model gets.

May import: serving.gateway.tools.tool_parsers.
"""
