"""The API's pydantic models: requests of completions and chat (with the structured-output fields
and the table of refused fields) and the response bodies of every endpoint.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.tools.
"""
