"""Test doubles for the gateway: a byte-level tokenizer and a scripted engine.

Nothing here imports JAX or the ``model`` package.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import AsyncIterator, Callable, Sequence

from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    EngineStats,
    RequestRejectedError,
    TokenEvent,
    TokenLogprobs,
)

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # id = 3 + one UTF-8 byte
START_OF_TURN_ID = BYTE_OFFSET + 256  # 259
END_OF_TURN_ID = START_OF_TURN_ID + 1  # 260
VOCAB_SIZE = END_OF_TURN_ID + 1
_CONTROL = {PAD_ID: "<pad>", EOS_ID: "<eos>", BOS_ID: "<bos>", START_OF_TURN_ID: "<start_of_turn>",
            END_OF_TURN_ID: "<end_of_turn>"}


class FakeTokenizer:
    """Byte-level tokenizer implementing ``TextTokenizer``.

    Every UTF-8 byte is its own token (id = 3 + byte), so a multi-byte
    character always spans several tokens, as with SentencePiece byte fallback.
    Ids 0 (pad), 1 (eos), 2 (bos), 259 (<start_of_turn>), 260 (<end_of_turn>)
    are control tokens that decode to ""; ``encode_markup`` turns their
    spellings into their ids. Pieces (``id_to_piece``) are the character of an
    ASCII byte, ``<0xNN>`` for the others (SentencePiece's byte fallback).
    """

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE
    add_bos = True
    chat_template_source = "{{ messages }}"
    special_tokens = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (EOS_ID, END_OF_TURN_ID)

    @property
    def chat_stop_token_ids(self) -> tuple[int, ...]:
        return (EOS_ID, END_OF_TURN_ID, START_OF_TURN_ID)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [BYTE_OFFSET + b for b in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_bos else ids

    def encode_markup(self, text: str) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            at = min(((rest.find(s), s) for s in _CONTROL.values() if s in rest), default=None)
            if at is None:
                return ids + self.encode(rest)
            ids += self.encode(rest[:at[0]])
            ids.append(next(i for i, s in _CONTROL.items() if s == at[1]))
            rest = rest[at[0] + len(at[1]):]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            if not 0 <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} is outside [0, {VOCAB_SIZE})")
            if BYTE_OFFSET <= i < START_OF_TURN_ID:
                out.append(i - BYTE_OFFSET)
        return out.decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        """SentencePiece-style spelling: byte tokens ``<0xHH>``, control tokens by name."""
        if BYTE_OFFSET <= i < START_OF_TURN_ID:
            return f"<0x{i - BYTE_OFFSET:02X}>"
        return {PAD_ID: "<pad>", EOS_ID: "<eos>", BOS_ID: "<bos>", START_OF_TURN_ID: "<start_of_turn>",
                END_OF_TURN_ID: "<end_of_turn>"}[i]

    def is_control(self, i: int) -> bool:
        return not BYTE_OFFSET <= i < START_OF_TURN_ID

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Gemma-3-like: a leading system message is folded into the first user turn.
        Tools become a leading system line ``tools: <JSON>``, a ``tool`` message a
        user turn ``tool: <content>``, an assistant's tool calls ``calls: <JSON>``."""
        msgs = [dict(m) for m in messages]
        if not msgs:
            raise ValueError("messages must not be empty")
        for m in msgs:
            if m["role"] == "tool":
                m.update(role="user", content=f"tool: {m['content']}")
            if m.get("tool_calls"):
                m["content"] = f"{m['content']}calls: {json.dumps(m['tool_calls'])}"
        if tools:
            line = f"tools: {json.dumps(list(tools))}"
            if msgs[0]["role"] == "system":
                msgs[0]["content"] = f"{msgs[0]['content']}\n{line}"
            else:
                msgs.insert(0, {"role": "system", "content": line})
        system = None
        if msgs[0]["role"] == "system":
            system = str(msgs[0]["content"]).strip()
            msgs = msgs[1:]
        ids = [BOS_ID]
        for i, m in enumerate(msgs):
            role, content = m["role"], m["content"]
            if role == "system":
                raise ValueError("a system message is only allowed first")
            if role not in ("user", "assistant"):
                raise ValueError(f"unknown role {role!r}")
            if not isinstance(content, str):
                raise ValueError("only text content is supported")
            content = content.strip()
            if i == 0 and system is not None:
                content = f"{system}\n\n{content}"
            name = "model" if role == "assistant" else "user"
            ids += [START_OF_TURN_ID, *self.encode(f"{name}\n{content}"), END_OF_TURN_ID]
            ids += self.encode("\n")
        ids += [START_OF_TURN_ID, *self.encode("model\n")]
        return ids


THINK_START_ID, THINK_END_ID = VOCAB_SIZE, VOCAB_SIZE + 1  # 261, 262: ThinkingTokenizer only


class ThinkingTokenizer(FakeTokenizer):
    """FakeTokenizer plus ``<think>`` (261) and ``</think>`` (262) tokens (not control
    tokens: they decode to their text, as Qwen3's do), and a
    Jinja-like ``chat_template`` whose source writes ``<think>`` (so "auto" picks the
    reasoning parser). With ``opens_thinking`` the chat prompt ends with ``<think>``
    (as DeepSeek-R1's template does)."""

    vocab_size = VOCAB_SIZE + 2

    def __init__(self, opens_thinking: bool = False) -> None:
        self.opens_thinking = opens_thinking
        self.chat_template = type("Template", (), {"source": "{{ messages }}<think>"})()

    def encode_markup(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.replace("</think>", "\0e").replace("<think>", "\0s").split("\0")):
            if i:
                ids.append(THINK_START_ID if part[0] == "s" else THINK_END_ID)
                part = part[1:]
            ids += super().encode_markup(part)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        # Qwen3's and DeepSeek-R1's <think> tokens are added tokens that are not special:
        # they decode to their text.
        out, run = [], []
        for i in ids:
            if i in (THINK_START_ID, THINK_END_ID):
                out += [super().decode(run), "<think>" if i == THINK_START_ID else "</think>"]
                run = []
            else:
                run.append(i)
        return "".join(out) + super().decode(run)

    def id_to_piece(self, i: int) -> str:
        return {THINK_START_ID: "<think>", THINK_END_ID: "</think>"}.get(i) or super().id_to_piece(i)

    def is_control(self, i: int) -> bool:
        return i not in (THINK_START_ID, THINK_END_ID) and super().is_control(i)

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        ids = super().apply_chat_template(messages, tools)
        return ids + [THINK_START_ID] if self.opens_thinking else ids


Responder = Callable[[EngineRequest], Sequence[int]]


def fake_logprobs(token_id: int, position: int, k: int) -> TokenLogprobs:
    """The fake engine's deterministic log probabilities of `token_id` at `position`
    (0-based in prompt + output): its logprob is ``-0.25 - ((token_id + position) % 7) / 8``,
    and the top-k are ids ``(token_id + 1 + i) % VOCAB_SIZE`` with logprob ``-0.125 - i / 4``
    (sorted, most likely first)."""
    logprob = -0.25 - ((token_id + position) % 7) / 8
    top = tuple(((token_id + 1 + i) % VOCAB_SIZE, -0.125 - i / 4) for i in range(k))
    return TokenLogprobs(token_id, logprob, top)


def fake_prompt_logprobs(prompt_ids: Sequence[int], k: int) -> tuple[TokenLogprobs | None, ...]:
    """What the fake engine reports as ``prompt_logprobs`` (None for the first token)."""
    return (None, *(fake_logprobs(t, p, k) for p, t in enumerate(prompt_ids) if p > 0))


@dataclasses.dataclass
class FakeEngine:
    """A scripted ``EngineClient``.

    For each request, ``responder(request)`` gives the token ids to generate
    (default: the bytes of ``text``). Tokens are streamed in events of
    ``chunk`` ids, ``delay`` seconds apart. Generation ends with "stop" after a
    stop token, "length" at ``max_tokens``; when the script runs out an EOS is
    generated. ``fail_after`` ends with "error" after that many tokens (only
    requests whose id ends with one of ``fail_only``, when given).
    With ``sampling.logprobs`` every event carries :func:`fake_logprobs` of its
    tokens; with ``sampling.prompt_logprobs`` the first event carries
    :func:`fake_prompt_logprobs`; ``max_tokens`` 0 (with prompt logprobs)
    answers one event with no token, finish "length".

    Flags: ``overloaded`` / ``reject`` make ``submit`` raise
    ``EngineOverloadedError`` / ``RequestRejectedError``; ``ready`` is what
    ``is_ready`` returns; ``load`` is what ``stats`` returns.

    Records: ``submitted`` (EngineRequests), ``cancelled`` (request ids passed
    to ``cancel``), ``first_token`` (set once any request emits a token).
    """

    text: str = "Hello world"
    responder: Responder | None = None
    chunk: int = 1
    delay: float = 0.0
    cached_tokens: int = 0
    fail_after: int | None = None
    fail_only: tuple[str, ...] = ()
    overloaded: bool = False
    reject: bool = False
    ready: bool = True
    load: EngineStats = EngineStats()
    model_len: int = 512
    submitted: list[EngineRequest] = dataclasses.field(default_factory=list)
    cancelled: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self._cancel_flags: dict[str, asyncio.Event] = {}
        self.first_token = asyncio.Event()

    @property
    def max_model_len(self) -> int:
        return self.model_len

    def is_ready(self) -> bool:
        return self.ready

    def stats(self) -> EngineStats:
        return self.load

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        flag = self._cancel_flags.get(request_id)
        if flag is not None:
            flag.set()

    def submit(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        if self.overloaded:
            raise EngineOverloadedError("waiting queue is full")
        if self.reject:
            raise RequestRejectedError("request can never fit in the KV cache")
        self.submitted.append(request)
        flag = self._cancel_flags[request.request_id] = asyncio.Event()
        if self.responder is not None:
            script = list(self.responder(request))
        else:
            script = [BYTE_OFFSET + b for b in self.text.encode("utf-8")]
        return self._run(request, script, flag)

    async def _run(
        self, request: EngineRequest, script: list[int], flag: asyncio.Event
    ) -> AsyncIterator[TokenEvent]:
        sp = request.sampling
        stops = set(sp.stop_token_ids)
        n_prompt = len(request.prompt_ids)
        done = 0
        pending: list[int] = []
        finish = None
        error = None
        prompt_lp = (None if sp.prompt_logprobs is None
                     else fake_prompt_logprobs(request.prompt_ids, sp.prompt_logprobs))

        def event(ids: tuple[int, ...], **kw) -> TokenEvent:
            nonlocal prompt_lp
            start = n_prompt + done - len(ids)
            lps = (None if sp.logprobs is None
                   else tuple(fake_logprobs(t, start + i, sp.logprobs) for i, t in enumerate(ids)))
            ev = TokenEvent(request.request_id, ids, prompt_tokens=n_prompt,
                            cached_tokens=self.cached_tokens, completion_tokens=done, logprobs=lps,
                            prompt_logprobs=prompt_lp, **kw)
            prompt_lp = None
            return ev

        try:
            if sp.max_tokens == 0:
                await asyncio.sleep(0)
                yield event((), finish_reason="length")
                return
            while finish is None:
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await asyncio.sleep(0)
                if flag.is_set():
                    finish = "cancelled"
                    break
                tok = script[done] if done < len(script) else EOS_ID
                pending.append(tok)
                done += 1
                self.first_token.set()
                fails = not self.fail_only or request.request_id.endswith(self.fail_only)
                if self.fail_after is not None and fails and done >= self.fail_after:
                    finish, error = "error", "device fell over"
                elif tok in stops and not sp.ignore_eos:
                    finish = "stop"
                elif done >= sp.max_tokens:
                    finish = "length"
                if finish is None and len(pending) < self.chunk:
                    continue
                yield event(tuple(pending), finish_reason=finish, error=error)
                pending = []
            if finish == "cancelled":
                yield TokenEvent(
                    request.request_id,
                    (),
                    finish_reason="cancelled",
                    prompt_tokens=n_prompt,
                    completion_tokens=done,
                )
        finally:
            self._cancel_flags.pop(request.request_id, None)
