"""Who may call and what they used: the database (SQLAlchemy), API keys and tenants, bearer
authentication, rate limits (in process, or shared through Redis), the usage ledger (with its
spool for database outages and the gateway instances that write it) and prices.

May import: serving.config, serving.gateway.http.
"""
