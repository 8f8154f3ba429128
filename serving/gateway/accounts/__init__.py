"""Who may call and what they used: the database (SQLAlchemy), API keys and tenants, bearer
authentication, rate limits (in process, or shared through Redis), the usage ledger (with its
spool for database outages and the gateway instances that write it), prices, and the audit trail
of key and tenant changes.

May import: serving.config, serving.gateway.http.
"""
