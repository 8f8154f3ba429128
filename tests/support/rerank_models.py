"""Where the tiny rerankers of tests/data/rerank_tiny live (made by its make_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

RERANK_TINY = Path(__file__).resolve().parents[1] / "data" / "rerank_tiny"


def golden(case: str) -> dict:
    """golden.json of a case ("bert_cross", "xlmr_cross" or "qwen3_rerank")."""
    return json.loads((RERANK_TINY / case / "golden.json").read_text())
