"""A checkpoint's own Jinja chat template: rendered as transformers renders it, encoded safely.

**Rendering.** :meth:`JinjaChatTemplate.render` gives the string that
``transformers``' ``tokenizer.apply_chat_template(messages, tokenize=False)``
gives (learned from ``transformers/utils/chat_template_utils.py``, written
here independently; parity is tested against recorded transformers output in
``tests/data/chat_templates/``). The environment is the same:

- ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension (``break``/``continue``) and
  a ``{% generation %}...{% endgeneration %}`` block that renders its body
  (transformers uses it to mark assistant tokens; rendering is unchanged);
- a ``tojson`` filter that is ``json.dumps`` with ``ensure_ascii=False`` and the
  ``indent``, ``separators`` and ``sort_keys`` arguments (jinja2's own escapes
  HTML characters and sorts keys; transformers replaces it, and so do we);
- globals ``raise_exception(message)`` (the template's refusal: our
  :meth:`~JinjaChatTemplate.render` raises ``ValueError(message)``, which the
  gateway answers with 400), ``strftime_now(format)`` (local time now), and
  ``dict``/``namespace`` replaced by versions that expose no class attributes
  and store no underscore names (transformers hardens them the same way;
  jinja2 >= 3.1.6 has the sandbox fixes transformers requires);
- variables ``messages``, ``add_generation_prompt``, ``tools`` and
  ``documents`` (None when not given), plus the tokenizer's special tokens
  (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...: see
  ``model.chat_template_source.special_token_variables``) and any extra
  keyword (e.g. ``enable_thinking``);
- the messages as transformers 5 prepares them: keys whose value is None
  dropped (``"content": None`` is no content key), a reasoning text
  (``reasoning_content``, ``thinking`` or ``reasoning``) under both
  ``reasoning_content`` and ``thinking``.

**Encoding without letting user text become control tokens.**
:meth:`JinjaChatTemplate.encode` renders the messages twice: once as they are
(the reference string, equal to transformers'), once with every message text
(a ``content`` string, each text part's ``text``, a reasoning text) replaced by
a unique placeholder. The placeholder rendering is split at the placeholders:
the pieces between them are the template's own markup, encoded with
``tokenizer.encode_markup`` (control-token spellings become control ids); each
placeholder stands for a message's text, encoded with ``tokenizer.encode``
(control-token spellings stay plain text). So ``<|eot_id|>`` or ``<|im_end|>``
typed in a message is encoded as text, as on the Gemma path
(``model.chat_template``). (transformers 5 has an opt-in for the same
guarantee, ``sanitize_control_tokens=True``, done another way.)

Templates that transform a text (Llama 3's and Gemma 3's ``| trim``, Qwen3's
``.strip('\n')``) see the placeholder, not the text. Each placeholder is
therefore substituted back by the variant of its text that makes the
placeholder rendering equal the reference string: the text as it is, or with
``strip``, ``lstrip`` or ``rstrip`` applied (with no argument, or ``"\n"``);
the pieces are encoded only once that reconstruction equals the reference
string exactly, so the ids always spell transformers' string. When no variant
fits (the template's output depends on a text in another way, e.g. Qwen3
splitting an assistant message at ``</think>``), the reference string is
encoded whole with ``encode_markup``, as transformers does, but only if no
message text contains control-token text (``encode(t) != encode_markup(t)``);
otherwise ``ValueError`` names the message, rather than let its text become
control tokens. (In that fallback a text could still complete a control token
with the markup right after it, e.g. a message ending in ``<|im_`` before
markup starting ``end|>``; no template we know emits such markup.) Strings
rendered as markup that are not message texts (other message fields,
``tools``, ``documents``) must not contain control-token text (``ValueError``
naming the field).

The one known difference from transformers' ids: transformers tokenizes the
rendered string in one piece, we tokenize markup and texts separately, so
where a tokenizer would merge characters across a markup/text boundary (e.g.
a text ending in spaces followed by markup ``"\n\n"``) the ids differ; the
text they decode to is the same.

No JAX import here: the gateway renders prompts through this module.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime
from typing import Any, Iterator, Mapping, Protocol, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["JinjaChatTemplate", "MarkupTokenizer", "TemplateRaised"]


class MarkupTokenizer(Protocol):
    """The two encodings :meth:`JinjaChatTemplate.encode` needs. Neither adds BOS/EOS."""

    def encode(self, text: str) -> list[int]:
        """User text: control-token spellings (``<|eot_id|>``, ``<start_of_turn>``) stay plain text."""

    def encode_markup(self, text: str) -> list[int]:
        """The template's markup: control-token spellings become their ids."""


class TemplateRaised(jinja2.TemplateError):
    """Raised by a template's ``raise_exception(message)``."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}BODY{% endgeneration %}`` renders BODY (transformers' assistant-mask tag)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)  # the "generation" name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter of transformers' environment: ``json.dumps`` with these defaults."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    """The ``dict(...)`` global: a plain function, so a template reaches no ``dict`` class attributes."""
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attribute names (as transformers'
    does), so a template cannot store or reach CPython internals through one."""

    def __init__(*args: Any, **kwargs: Any):  # noqa: N805 - jinja2.utils.Namespace's signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store the underscore-prefixed attribute {name!r} on a namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _make_dict
    env.globals["namespace"] = _Namespace
    return env


# Errors a template raises at render time on input it cannot take (the caller's
# messages), turned into ValueError. Bugs of ours would not come from inside render.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError,
                  ArithmeticError)

# Fields of a message that carry its text (rendered as text, never as markup), and the
# reasoning fields transformers fills from one another (``_normalize``).
_TEXT_FIELDS = ("content", "reasoning_content", "thinking", "reasoning")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# How a template may have transformed a content (see the module docstring), tried in order.
_VARIANTS = (lambda s: s, str.strip, str.lstrip, str.rstrip,
             lambda s: s.strip("\n"), lambda s: s.lstrip("\n"), lambda s: s.rstrip("\n"))


class JinjaChatTemplate:
    """A compiled Jinja chat template and the special-token variables it renders with.

    Thread-safe after construction (a compiled jinja2 template keeps no render state).

    Args:
      source: the template text (e.g. ``tokenizer_config.json``'s ``chat_template``).
      variables: the tokenizer's special tokens as template variables
        (``{"bos_token": "<|begin_of_text|>", "eos_token": ..., ...}``); the
        values are passed as they are.
      name: where the template came from, for error messages (a file name).

    Raises:
      ValueError: the template does not parse (``jinja2.TemplateSyntaxError``:
        the message names ``name`` and the line).
    """

    def __init__(self, source: str, variables: Mapping[str, Any] | None = None, *,
                 name: str = "chat template"):
        if not isinstance(source, str):
            raise ValueError(f"{name}: a chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.name = name
        self.variables = dict(variables or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{name} is not a valid Jinja template: {e.message} (line {e.lineno})") from None

    def __repr__(self) -> str:
        return f"JinjaChatTemplate(name={self.name!r}, {len(self.source)} characters)"

    # ---------------------------------------------------------------- render

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text, equal to transformers' ``apply_chat_template(..., tokenize=False)``.

        Args:
          messages: ``[{"role": str, "content": str | list of parts | None, ...}]``;
            as transformers does, keys whose value is None are left out, and a
            message's reasoning (``reasoning_content``, ``thinking`` or
            ``reasoning``, the first set) is passed under the first two names.
          add_generation_prompt: open the assistant's turn at the end.
          tools: JSON-schema tool descriptions (``[{"type": "function", "function": {...}}]``),
            or None.
          **kwargs: further template variables (e.g. ``enable_thinking=False``);
            they override the special-token variables.

        Returns:
          The rendered text; control tokens are spelled out, so never encode it
          with control-token parsing on to get model input: use :meth:`encode`.

        Raises:
          ValueError: no messages, a message that is not a mapping, the
            template refused the messages (``raise_exception``: its message as
            it is) or failed on them (an undefined attribute, a wrong type: the
            message names the template).
        """
        context = {"documents": None, **self.variables, **kwargs, "messages": _normalize(messages),
                   "tools": tools, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except TemplateRaised as e:
            raise ValueError(str(e)) from None
        except _RENDER_ERRORS as e:
            raise ValueError(f"the chat template ({self.name}) failed on these messages: "
                             f"{type(e).__name__}: {e}") from None

    # ---------------------------------------------------------------- encode

    def encode(self, messages: Sequence[Mapping[str, Any]], tokenizer: MarkupTokenizer, *,
               add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> list[int]:
        """Prompt ids for ``messages``: markup with control ids, contents as plain text.

        See the module docstring for the method. BOS comes only from the
        template (``{{ bos_token }}``), as in transformers.

        Args:
          messages, add_generation_prompt, tools, kwargs: as :meth:`render`.
          tokenizer: a :class:`MarkupTokenizer`.

        Returns:
          ``list[int]`` whose decoding (control tokens spelled) is :meth:`render`'s text.

        Raises:
          ValueError: as :meth:`render`; a string rendered as markup that holds
            control-token text (a message field other than its texts, a tool
            description, a document); control-token text in a message when
            the template rewrites message texts beyond trimming (see the
            module docstring).
        """
        reference = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                **kwargs)
        _check_plain(tokenizer, _other_strings(messages), "messages")
        if tools is not None:
            _check_plain(tokenizer, _strings(tools, "tools"), "tools")
        if kwargs.get("documents") is not None:
            _check_plain(tokenizer, _strings(kwargs["documents"], "documents"), "documents")
        mark = f"\ue000{secrets.token_hex(6)}"
        if any(mark in text for _, text in _contents(messages)) or mark in self.source:
            raise ValueError("a message contains this render's placeholder text")  # ~2^-48
        contents: list[str] = []
        masked = _with_placeholders(messages, mark, contents)
        rendered = self.render(masked, add_generation_prompt=add_generation_prompt, tools=tools,
                               **kwargs)
        pieces = _split(rendered, mark, contents)
        texts = None if pieces is None else _substitute(pieces, reference)
        if texts is None:  # the template's output depends on a content beyond trimming
            for where, text in _contents(messages):
                if text and tokenizer.encode(text) != tokenizer.encode_markup(text):
                    raise ValueError(
                        f"{where} contains control-token text, and this chat template "
                        f"({self.name}) rewrites message text in a way that keeping it plain "
                        f"cannot follow (see model/jinja_chat_template.py); remove the "
                        f"control-token text")
            return list(tokenizer.encode_markup(reference))
        ids: list[int] = []
        for is_content, text in texts:
            if text:
                ids.extend(tokenizer.encode(text) if is_content else tokenizer.encode_markup(text))
        return ids


# -------------------------------------------------------------------- helpers


def _normalize(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """What transformers hands the template: copies without None-valued keys, reasoning aliased."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        msg = {k: v for k, v in msg.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _content_parts(content: Any) -> Iterator[tuple[str, str]]:
    """(sub-path, text) of a content's texts: the string itself, or each part's ``text``."""
    if isinstance(content, str):
        yield "", content
    elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield f"[{j}].text", part["text"]


def _contents(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, str]]:
    """("messages[i].FIELD...", text) for every text of the ``_TEXT_FIELDS``."""
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping):
            for field in _TEXT_FIELDS:
                for sub, text in _content_parts(msg.get(field)):
                    yield f"messages[{i}].{field}{sub}", text


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, s) for every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(k, str):
                yield f"{path} key {k!r}", k
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        for j, v in enumerate(value):
            yield from _strings(v, f"{path}[{j}]")


def _other_strings(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, str]]:
    """Strings of the messages other than their texts (roles, names, tool calls, ...)."""
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            continue
        for key, value in msg.items():
            where = f"messages[{i}].{key}"
            if key not in _TEXT_FIELDS:
                yield from _strings(value, where)
            elif isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
                for j, part in enumerate(value):  # a part's fields other than its text
                    if isinstance(part, Mapping):
                        for k, v in part.items():
                            if not (k == "text" and isinstance(v, str)):
                                yield from _strings(v, f"{where}[{j}].{k}")


def _check_plain(tokenizer: MarkupTokenizer, strings: Iterator[tuple[str, str]], what: str) -> None:
    for where, s in strings:
        if s and tokenizer.encode(s) != tokenizer.encode_markup(s):
            raise ValueError(f"{where} contains control-token text, which is not allowed in {what} "
                             f"outside message contents")


def _with_placeholders(messages: Sequence[Mapping[str, Any]], mark: str, contents: list[str]) -> list:
    """Copies of the messages with each non-empty content text replaced by ``mark + index + mark``.

    Empty texts stay empty, so a template's ``if message.content`` still sees them as empty.
    """

    def hold(text: str) -> str:
        if not text:
            return text
        contents.append(text)
        return f"{mark}{len(contents) - 1}{mark}"

    out = []
    for msg in messages:
        if not isinstance(msg, Mapping):
            out.append(msg)
            continue
        msg = dict(msg)
        for field in _TEXT_FIELDS:
            content = msg.get(field)
            if isinstance(content, str):
                msg[field] = hold(content)
            elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
                msg[field] = [
                    {**part, "text": hold(part["text"])}
                    if isinstance(part, Mapping) and isinstance(part.get("text"), str) else part
                    for part in content]
        out.append(msg)
    return out


def _split(rendered: str, mark: str, contents: list[str]) -> list | None:
    """The placeholder rendering as markup strings and ``(index, content text)`` pairs, or
    None if a placeholder came out mangled (the template cut or changed it)."""
    chunks = rendered.split(mark)
    if len(chunks) % 2 == 0:
        return None
    pieces: list[str | int] = []
    for k, chunk in enumerate(chunks):
        if k % 2 == 0:
            pieces.append(chunk)
        elif chunk.isdigit() and int(chunk) < len(contents):
            pieces.append(int(chunk))
        else:
            return None
    return [(p, contents[p]) if isinstance(p, int) else p for p in pieces]


def _substitute(pieces: list, reference: str) -> list[tuple[bool, str]] | None:
    """[(is_content, text)] spelling ``reference`` exactly, each content replaced by the
    first variant (``_VARIANTS``) after which the reference goes on with the next markup;
    None if there is none."""
    out: list[tuple[bool, str]] = []
    pos = 0
    for k, piece in enumerate(pieces):
        if isinstance(piece, str):
            if not reference.startswith(piece, pos):
                return None
            out.append((False, piece))
            pos += len(piece)
            continue
        text = piece[1]
        following = pieces[k + 1] if k + 1 < len(pieces) and isinstance(pieces[k + 1], str) else ""
        for variant in dict.fromkeys(v(text) for v in _VARIANTS):
            if reference.startswith(variant + following, pos):
                out.append((True, variant))
                pos += len(variant)
                break
        else:
            return None
    return out if pos == len(reference) else None
