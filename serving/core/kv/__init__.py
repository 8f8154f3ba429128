"""KV-cache pages on the host: who owns which page, reference counts, the prefix cache's chained
page hashes, the KV events routers follow, and the host-memory tier of evicted pages. No JAX.

May import: nothing of ours.
"""
