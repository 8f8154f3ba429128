"""A model the gateway serves: its name, engine, tokenizer, context window and KV-cache capacity,
and whether it generates text, embeds it or scores pairs of texts (``task``)."""

from __future__ import annotations

import dataclasses
import time

from serving.contract.embedding_client import EmbeddingClient
from serving.contract.engine_client import EngineClient
from serving.contract.scoring_client import PairEncoder
from serving.contract.tokenizer_protocol import TextTokenizer


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A model the gateway serves.

    Attributes:
      name: the id clients pass as ``model``.
      engine: generates tokens for it.
      tokenizer: its text <-> ids mapping and chat template.
      max_model_len: context window in tokens (prompt + completion).
      created: Unix seconds reported by ``/v1/models``.
      kv_capacity_tokens: the most tokens (prompt + completion) one request
        can hold in the engine's KV cache (``EngineClient.kv_capacity_tokens``);
        None: no bound beyond the context window.
      default_chat_max_tokens: the operator's cap on the completion of a chat
        request that sends no ``max_tokens`` (None: the largest that fits,
        :attr:`max_request_tokens` minus the prompt).
      tool_call_parser: the format its tool calls are parsed from (a name of
        ``tool_parsers.TOOL_PARSERS``; None: it cannot choose to call tools).
      reasoning_parser: "think" when it thinks in ``<think>...</think>`` (the
        thinking is returned apart as ``reasoning_content``); None: it does not.
      task: "generate" (completions, chat, responses) or "embed" (``/v1/embeddings`` only;
        ``engine`` is then a ``serving.contract.embedding_client.EmbeddingClient``).
        "rerank" (``/v1/rerank`` and ``/v1/score`` only; ``engine`` is then also a
        ``serving.contract.scoring_client.ScoringClient``).
      embedding_dim: an embedding model's vector width.
      matryoshka_dims: the smaller sizes an embedding model was trained to be truncated to
        (``dimensions``); empty: not Matryoshka.
      vocab_size: the model's vocabulary (token-id inputs must lie in it); None: the tokenizer's.
      lora_name: a LoRA adapter the engine serves over its base model (the request's
        ``EngineRequest.lora_name``); None: the base model itself.
      parent: the base model's name, for an adapter (``/v1/models`` reports it).
      pair_encoder: a rerank model's framing of a (query, document) pair
        (``serving.contract.scoring_client.PairEncoder``); None for other tasks.
    """

    name: str
    engine: EngineClient | EmbeddingClient
    tokenizer: TextTokenizer
    max_model_len: int
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    kv_capacity_tokens: int | None = None
    default_chat_max_tokens: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    task: str = "generate"
    embedding_dim: int | None = None
    matryoshka_dims: tuple[int, ...] = ()
    vocab_size: int | None = None
    lora_name: str | None = None
    parent: str | None = None
    pair_encoder: PairEncoder | None = None

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + completion) one request can ever have: the
        smaller of the context window and the KV-cache capacity."""
        if self.kv_capacity_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, self.kv_capacity_tokens)


def adapter_model(base: ServedModel, lora_name: str) -> ServedModel:
    """The served model of LoRA adapter ``lora_name`` over ``base`` (same engine and tokenizer)."""
    return ServedModel(name=lora_name, engine=base.engine, tokenizer=base.tokenizer,
                       max_model_len=base.max_model_len, kv_capacity_tokens=base.kv_capacity_tokens,
                       default_chat_max_tokens=base.default_chat_max_tokens,
                       tool_call_parser=base.tool_call_parser, reasoning_parser=base.reasoning_parser,
                       lora_name=lora_name, parent=base.name)
