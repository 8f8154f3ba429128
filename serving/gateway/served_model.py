"""A model the gateway serves: its name, engine, tokenizer and context window."""

from __future__ import annotations

import dataclasses
import time

from serving.engine_client import EngineClient
from serving.tokenizer_protocol import TextTokenizer


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A model the gateway serves.

    Attributes:
      name: the id clients pass as ``model``.
      engine: generates tokens for it.
      tokenizer: its text <-> ids mapping and chat template.
      max_model_len: context window in tokens (prompt + completion).
      created: Unix seconds reported by ``/v1/models``.
    """

    name: str
    engine: EngineClient
    tokenizer: TextTokenizer
    max_model_len: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
