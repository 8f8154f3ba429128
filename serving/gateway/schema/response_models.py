"""Pydantic models of the API's responses (OpenAI's shapes); the error body's are in ``serving.gateway.http.errors``.

Log probabilities follow OpenAI's two shapes: ``/v1/completions`` has the
legacy ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}`` (:class:`CompletionLogprobs`), chat has ``{content: [{token,
logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``
(:class:`ChatLogprobs`). How token ids become the ``token`` strings is
``token_text.py``'s business; building these objects is ``choice_logprobs.py``'s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_serializer


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """``usage.completion_tokens_details``: generated tokens spent thinking (part of
    ``completion_tokens``, billed as output)."""

    reasoning_tokens: int = 0


class Usage(BaseModel):
    """Token counts: ``total_tokens = prompt_tokens + completion_tokens``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           reasoning_tokens: int = 0) -> "Usage":
        """Usage from token counts (total computed)."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
        )


class CompletionLogprobs(BaseModel):
    """``choices[].logprobs`` of ``/v1/completions`` (OpenAI's legacy shape), one entry
    per token: with ``echo`` the prompt's tokens first (the first one's logprob and
    top are null, as nothing precedes it), then the generated ones (the stop
    token's entry included, though its text is not in ``text``).

    Attributes:
      tokens: each token's text (see ``token_text.py``).
      token_logprobs: each token's log probability (natural log, float32 log-softmax).
      top_logprobs: the ``logprobs`` most likely tokens at each position, and the
        token itself ({token: logprob}; up to ``logprobs + 1`` keys).
      text_offset: each token's start in ``text``, in characters.
    """

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One ``/v1/completions`` choice (``text`` is the delta in streaming chunks)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Non-streaming ``/v1/completions`` body; streaming chunks share this shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    service_tier: str | None = None  # the tier served


class TopLogprob(BaseModel):
    """One alternative at a position of a chat completion.

    Attributes:
      token: its text (see ``token_text.py``).
      logprob: its log probability.
      bytes: the UTF-8 bytes the token contributes to the text; null for a
        control token (it contributes none).
    """

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """One generated token of a chat completion and its ``top_logprobs`` alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat completion: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class _DropNone(BaseModel):
    """Unset (None) fields are left out of the JSON."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallOut(BaseModel):
    """A called function: its name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    """The assistant message of a non-streaming chat completion.

    ``content`` is null when the model only called tools; ``reasoning_content``
    (the thinking, for models that think) and ``tool_calls`` are left out
    when there are none.
    """

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_extras(self, handler):
        d = handler(self)
        for k in ("reasoning_content", "tool_calls"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


class ChatChoice(BaseModel):
    """One non-streaming chat choice."""

    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """Non-streaming ``/v1/chat/completions`` body."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    service_tier: str | None = None  # the tier served


class DeltaFunctionCall(_DropNone):
    """The function part of a streamed tool-call delta: ``name`` on the call's
    first delta only; ``arguments`` "" there, then fragments of the JSON text."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """One streamed tool-call delta (OpenAI's shape): the call's first delta has
    ``index``, ``id``, ``type`` and ``function.name``; later ones ``index`` and
    ``function.arguments`` fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_DropNone):
    """A streaming delta; unset (None) fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a streaming chat chunk."""

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """A ``chat.completion.chunk`` SSE payload (``choices == []`` on the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = None  # the tier served


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models`` (``max_model_len`` in tokens, as vLLM reports it; a LoRA
    adapter names its base model as ``parent``, null for a base model)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "xlaserve"
    max_model_len: int | None = None
    parent: str | None = None


class ModelList(BaseModel):
    """``GET /v1/models`` body."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(BaseModel):
    """``GET /health`` body: ``{"status": "ok"}`` (200) or, with 503, the models not ready."""

    status: Literal["ok", "unavailable"]
    not_ready: list[str] | None = None


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` body (vLLM's route): the special tokens' spellings and
    ids (null when the model has none), the chat template's source (null when the
    model's template is built in rather than a Jinja text), and the context window."""

    model: str
    eos_token: str | None = None
    eos_token_id: int | None = None
    bos_token: str | None = None
    bos_token_id: int | None = None
    pad_token: str | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None
    vocab_size: int
    max_model_len: int


class TokenizeResponse(BaseModel):
    """``POST /tokenize`` body."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    """``POST /detokenize`` body."""

    prompt: str
