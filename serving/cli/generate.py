"""``xlaserve generate``: one prompt, streamed as text to a writer.

:func:`cmd_generate` builds the engine (JAX) and calls these; they only need an
:class:`~serving.contract.engine_client.EngineClient` and a tokenizer, so they run
against a fake engine in tests. Text comes from the output pipeline
(``serving/output/output_processor.py``): stop-token ids, stop strings and the
engine cancel on a stop string are handled there, as for the HTTP gateway.
Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import time
import uuid
from typing import Callable, Sequence

from serving.cli.bootstrap import build_engine
from serving.cli.settings import _add_settings, _overrides
from serving.contract.engine_client import EngineClient, EngineRequest, SamplingParams, TokenEvent
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.output.output_processor import GenerationError, TextGeneration


def register(sub) -> None:
    """Adds the ``generate`` subcommand to the CLI's subparsers."""
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    _add_settings(gen)
    gen.add_argument("prompt", help="prompt text (BOS is added)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from serving.config.server_config import load_server_config

    overrides = _overrides(args)
    overrides.setdefault("max_slots", 8)
    overrides.setdefault("num_pages", 1024)
    overrides.setdefault("max_model_len", 4096)
    cfg = load_server_config(args.config, **overrides)
    loop, tokenizer, _ = build_engine(cfg, warmup=False)

    def write(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    async def run(request):
        try:
            return await generate_text(loop, tokenizer, request, args.stop or (), write)
        finally:
            # Stop the engine thread while this event loop is still open: after a stop
            # string cancels the request, a step in flight may still send it events.
            await asyncio.to_thread(loop.stop)

    try:
        request = build_request(tokenizer, args.prompt, chat=args.chat, max_tokens=args.max_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed)
        result = asyncio.run(run(request))
    except GenerationError as e:
        sys.stdout.write("\n")
        print(f"xlaserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        loop.stop()
    sys.stdout.write("\n")
    print(result.summary(), file=sys.stderr)
    return 0



def build_request(tokenizer: TextTokenizer, prompt: str, *, chat: bool = False, max_tokens: int = 64,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None) -> EngineRequest:
    """The engine request for `prompt`.

    Args:
      prompt: plain text; BOS is added, or with `chat` it is wrapped in the
        tokenizer's chat template as one user message.
      max_tokens, temperature, top_k, top_p, seed: see
        :class:`~serving.contract.engine_client.SamplingParams`.

    Returns:
      An EngineRequest with a fresh id, stopping at the tokenizer's stop tokens
      (with `chat`, its chat stop tokens: the next turn's opening ends it too).

    Raises:
      ValueError: the chat template rejects the message.
    """
    if chat:
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    else:
        prompt_ids = tokenizer.encode(prompt, add_bos=True)
    return EngineRequest(
        request_id=uuid.uuid4().hex, prompt_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed,
                                stop_token_ids=tuple(tokenizer.chat_stop_token_ids if chat
                                                     else tokenizer.stop_token_ids)),
        arrival_time=time.time())


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What one ``generate`` run produced.

    Attributes:
      text: the generated text (stop tokens and the stop string excluded).
      finish_reason: "stop" or "length".
      prompt_tokens, completion_tokens: token counts.
      ttft_s: seconds from submit to the first generated token (None if none came).
      elapsed_s: seconds from submit to the end.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    elapsed_s: float

    def summary(self) -> str:
        """The one-line report ``xlaserve generate`` prints to stderr."""
        rate = self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (f"[{self.prompt_tokens} prompt tokens, {self.completion_tokens} generated; "
                f"TTFT {self.ttft_s or 0:.3f} s, {rate:.1f} tokens/s overall (includes compiling)]")


async def generate_text(engine: EngineClient, tokenizer: TextTokenizer, request: EngineRequest,
                        stop: Sequence[str] = (),
                        write: Callable[[str], object] | None = None) -> GenerateResult:
    """Runs `request` on `engine`, passing each text delta to `write` as it arrives.

    Args:
      stop: stop strings (the text ends before the first; the engine request
        is cancelled then).
      write: called with each non-empty text delta (e.g. ``sys.stdout.write``).

    Returns:
      A :class:`GenerateResult`.

    Raises:
      EngineOverloadedError, RequestRejectedError: the engine did not admit it.
      GenerationError: the engine failed or cancelled the request.
    """
    t0 = time.perf_counter()
    first: list[float] = []

    def on_event(event: TokenEvent) -> None:
        if event.token_ids and not first:
            first.append(time.perf_counter() - t0)

    parts: list[str] = []
    async with TextGeneration(engine, request, tokenizer, stop, on_event=on_event) as gen:
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                parts.append(delta)
                if write is not None:
                    write(delta)
    return GenerateResult(
        text="".join(parts), finish_reason=gen.finish_reason or "", prompt_tokens=gen.prompt_tokens,
        completion_tokens=gen.completion_tokens, ttft_s=first[0] if first else None,
        elapsed_s=time.perf_counter() - t0)
