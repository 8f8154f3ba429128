"""A gateway process over the scripted fake engine, for tests that kill a gateway:
the real app, database and spool (``GatewayServices.open_server``) under uvicorn,
without a model to load (starts in about a second).

    python -m tests.support.fake_gateway --port P --database-url URL --spool-dir DIR [--delay S]

Every request generates ``--text`` (default: 400 "x"), one token every ``--delay`` seconds.
"""

from __future__ import annotations

import argparse

import uvicorn

from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer

MODEL = "fake"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--database-url", required=True)
    p.add_argument("--spool-dir", required=True)
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--text", default="x" * 400)
    args = p.parse_args()
    services = GatewayServices.open_server(database_url=args.database_url, ledger_spool_dir=args.spool_dir)
    engine = FakeEngine(text=args.text, delay=args.delay, model_len=4096)
    app = create_app({MODEL: ServedModel(MODEL, engine, FakeTokenizer(), 4096, created=1)}, services)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
