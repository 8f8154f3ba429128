"""Structured output on the real Gemma 3 270M: sampled JSON that always parses and validates.

Uses tests/serving/engine/test_engine_gemma.py's engine configuration, so the programs are the
ones that file compiles (the persistent compilation cache shares them).
"""

from __future__ import annotations

import asyncio
import json

import jax.numpy as jnp
import jsonschema
import pytest

from model.gemma3 import Gemma3
from serving.contract.engine_client import EngineRequest, SamplingParams, StructuredOutput
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop
from tests.support.engine_helpers import collect
from tests.support.gemma_engine import CFG

pytestmark = pytest.mark.gemma

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def test_sampled_json_follows_the_schema(gemma_params, gemma_tokenizer):
    """Sampled chat answers under a JSON schema parse and validate against it: eight requests,
    one per slot, so they decode together (up to 160 steps of the real Gemma 3 270M, each
    step's bitmask computed on the host)."""
    cfg, params = gemma_params
    loop = EngineLoop(Engine(Gemma3(cfg, params=params, dtype=jnp.float32), CFG), tokenizer=gemma_tokenizer)
    loop.start(warmup=False)
    try:
        tok = gemma_tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Make up a user record as JSON."}])
        so = StructuredOutput("json_schema", json.dumps(SCHEMA))
        # Worst case (one token per character) of this schema is under 160 tokens.
        reqs = [EngineRequest(f"json-{i}", prompt, SamplingParams(
            max_tokens=160, temperature=1.0, seed=100 + i, stop_token_ids=tok.chat_stop_token_ids,
            structured_output=so)) for i in range(CFG.max_slots)]

        async def main():
            return await asyncio.gather(*(collect(loop, r) for r in reqs))

        results = asyncio.run(main())
    finally:
        loop.stop()
    texts = set()
    for ids, events in results:
        assert events[-1].finish_reason == "stop", (events[-1], tok.decode(ids))
        text = tok.decode(ids)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) >= CFG.max_slots - 2  # sampled, not one greedy answer
