"""Who may call and what they used: the database (SQLAlchemy), API keys and tenants, bearer
authentication, rate limits (in process, or shared through Redis), the usage ledger and prices.

May import: serving.config, serving.gateway.http.
"""
