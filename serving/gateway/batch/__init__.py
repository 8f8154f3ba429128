"""OpenAI's Files and Batch APIs: uploaded files, the batch state machine and its storage, and
the runner that works through batches under a lease.

May import: serving.contract, serving.config, serving.output, serving.core, serving.gateway.http,
serving.gateway.accounts, serving.gateway.openai.
"""
