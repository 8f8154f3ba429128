"""The web console at ``/console`` (admin keys only): the overview's charts of usage, cost,
errors and latency from the ledger, the searchable request list and one request's trace as a
timeline, keys and tenants (through ``KeyStore``, audited), and a chat playground. Pages are
jinja2 templates with our own JavaScript and SVG charts, shipped as package data (no CDN).

May import: serving.contract, serving.gateway.http, serving.gateway.accounts.
"""
