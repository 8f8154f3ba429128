"""vLLM's tokenizer routes, at the server root: ``/tokenizer_info``, ``/tokenize``, ``/detokenize``.

lm-evaluation-harness's remote tokenizer (``lm_eval.utils.RemoteTokenizer``,
its ``local-completions`` model with ``tokenizer_backend=remote``) calls them
at the server root (the base URL without ``/v1/completions``):

- ``GET /tokenizer_info[?model=NAME]``: ``eos_token``, ``bos_token``,
  ``pad_token`` (spellings, null when the model has none), their ids,
  ``chat_template`` (the Jinja source when the model is served with one, else
  null), ``vocab_size`` and ``max_model_len``.
- ``POST /tokenize``: ``{"prompt", "add_special_tokens" (default true)}`` or
  ``{"messages", "add_generation_prompt" (default true)}``, optional
  ``"model"``; answers ``{"tokens", "count", "max_model_len"}``.
- ``POST /detokenize``: ``{"tokens", "model"?}`` answers ``{"prompt"}``
  (control tokens decode to "").

Special-token text: ``/tokenize``'s ``prompt`` is read as a tokenizer's
``encode`` with special tokens parsed (Hugging Face's default, which vLLM's
route keeps): ``"<eos>"`` is the EOS id, as that client derives the EOS and BOS
ids by tokenizing their spellings. ``add_special_tokens`` adds the BOS the
model uses. ``/v1/completions`` never does this to a text prompt (control
spellings stay text there), and chat ``messages`` keep that guarantee here
too: typed control text in a message is text; only the chat template's own
markup is control tokens (``add_generation_prompt`` false is refused: the
template always adds it).

Same authentication as the ``/v1`` routes (a key when keys exist; the model
must be one the key may use); errors in OpenAI's shape.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse, Response

from serving.contract.tokenizer_protocol import TextTokenizer
from serving.gateway.accounts.api_keys import Principal
from serving.gateway.http.errors import OpenAIError, model_not_found
from serving.gateway.http.openapi import error_responses, json_request_body
from serving.gateway.openai.openai_serving import OpenAIServing, read_json
from serving.gateway.openai.prompts import check_prompt_chars
from serving.gateway.openai.served_model import ServedModel
from serving.gateway.schema.protocol import ChatMessage, Text, _Request
from serving.gateway.schema.response_models import DetokenizeResponse, TokenizeResponse, TokenizerInfo


class TokenizeRequest(_Request):
    """``POST /tokenize``: exactly one of ``prompt`` (text) and ``messages`` (chat)."""

    model: Text | None = None
    prompt: Text | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt_or_messages",
                                      "Send exactly one of 'prompt' and 'messages'.", {"field": "prompt"})
        if self.messages is not None and not self.add_generation_prompt:
            raise PydanticCustomError(
                "generation_prompt", "'add_generation_prompt' false is not supported: the chat "
                "template always adds the generation prompt.", {"field": "add_generation_prompt"})
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def _markup_ids(tok: TextTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`text` with special-token spellings read as their ids (``encode_markup``),
    and the model's BOS first when `add_special_tokens`."""
    encode_markup = getattr(tok, "encode_markup", None)
    ids = encode_markup(text) if encode_markup is not None else tok.encode(text)
    if add_special_tokens:
        ids = tok.encode("", add_bos=True) + list(ids)
    return list(ids)


def _spelling(tok: TextTokenizer, name: str, token_id: int | None) -> str | None:
    spelled = (getattr(tok, "special_tokens", None) or {}).get(name)
    if spelled is None and token_id is not None and hasattr(tok, "id_to_piece"):
        spelled = tok.id_to_piece(token_id)
    return spelled


def tokenizer_info(served: ServedModel) -> TokenizerInfo:
    """The ``/tokenizer_info`` body of `served`."""
    tok = served.tokenizer
    template = getattr(tok, "chat_template", None)
    source = getattr(template, "source", None) or getattr(tok, "chat_template_source", None)
    ids = {"eos_token": tok.eos_id, "bos_token": tok.bos_id, "pad_token": getattr(tok, "pad_id", None)}
    fields: dict[str, Any] = {}
    for name, token_id in ids.items():
        fields[name] = _spelling(tok, name, token_id)
        fields[f"{name}_id"] = token_id
    return TokenizerInfo(model=served.name, chat_template=source if isinstance(source, str) else None,
                         vocab_size=tok.vocab_size, max_model_len=served.max_model_len, **fields)


def install_tokenizer_routes(app: FastAPI, serving: OpenAIServing, principal) -> None:
    """Adds the three routes to `app`; `principal` is the app's authentication dependency."""

    def pick(name: str | None, caller: Principal) -> ServedModel:
        if name is not None:
            return serving.model(name, caller)
        for served_name in serving.models:
            if caller.may_use(served_name):
                return serving.models[served_name]
        raise model_not_found("(any)")

    @app.get("/tokenizer_info", response_model=TokenizerInfo,
             responses=error_responses(401, 403, 404, 413))
    async def get_tokenizer_info(model: str | None = None,
                                 caller: Principal = Depends(principal)) -> Response:
        return JSONResponse(tokenizer_info(pick(model, caller)).model_dump(mode="json"))

    @app.post("/tokenize", openapi_extra=json_request_body(TokenizeRequest),
              response_model=TokenizeResponse, responses=error_responses(400, 401, 403, 404, 413, 415))
    async def tokenize(request: Request, caller: Principal = Depends(principal)) -> Response:
        req = TokenizeRequest.model_validate(await read_json(request))
        served = pick(req.model, caller)
        tok = served.tokenizer
        if req.prompt is not None:
            check_prompt_chars(len(req.prompt), serving.limits.max_prompt_chars, "prompt", "'prompt' is")
            ids = await serving.prompts.run(_markup_ids, tok, req.prompt, req.add_special_tokens)
        else:
            try:
                ids = await serving.prompts.chat(tok, [m.to_template() for m in req.messages])
            except ValueError as e:
                raise OpenAIError(f"Invalid 'messages': {e}", param="messages") from None
        body = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=served.max_model_len)
        return JSONResponse(body.model_dump(mode="json"))

    @app.post("/detokenize", openapi_extra=json_request_body(DetokenizeRequest),
              response_model=DetokenizeResponse, responses=error_responses(400, 401, 403, 404, 413, 415))
    async def detokenize(request: Request, caller: Principal = Depends(principal)) -> Response:
        req = DetokenizeRequest.model_validate(await read_json(request))
        served = pick(req.model, caller)
        vocab = served.tokenizer.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise OpenAIError(f"Token id {bad} in 'tokens' is outside the vocabulary [0, {vocab}).",
                              param="tokens")
        text = await serving.prompts.run(served.tokenizer.decode, req.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))
