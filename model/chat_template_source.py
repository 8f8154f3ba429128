"""Where a model's chat template comes from, and which one is served.

Sources, as transformers and llama.cpp store them:

- a Hugging Face checkpoint directory: ``chat_template.jinja`` (what
  transformers writes since 4.51), else ``tokenizer_config.json``'s
  ``chat_template``: a string, or a list of ``{"name", "template"}`` of which
  the one named ``"default"`` is used, as transformers does when no name is
  asked for; the special tokens of the same ``tokenizer_config.json`` become
  the template's variables (:func:`special_token_variables`);
- a GGUF file: the ``tokenizer.chat_template`` metadata string, with
  ``bos_token``/``eos_token`` spelled from ``tokenizer.ggml.bos_token_id`` /
  ``eos_token_id`` and ``tokenizer.ggml.tokens``;
- a ``--chat-template FILE`` override (:func:`read_chat_template_file`): Jinja
  text, or a JSON file with a ``chat_template`` field.

:func:`pick_chat_template` chooses: the override file, else the checkpoint's
own template, else None, which means our Gemma 3 template
(``model.chat_template``) for a model that carries none.

:class:`TemplatedTokenizer` gives a tokenizer a Jinja template as its
``apply_chat_template``.

No JAX import here: the gateway renders prompts through these templates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from model.jinja_chat_template import JinjaChatTemplate

__all__ = ["special_token_variables", "template_from_tokenizer_config", "load_checkpoint_chat_template",
           "load_gguf_chat_template", "read_chat_template_file", "pick_chat_template",
           "TemplatedTokenizer"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


def _token_text(value: Any, where: str) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an AddedToken
    object ``{"content": str, ...}``; None when unset."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where} must be a string or an object with a 'content' string, got {value!r}")


def special_token_variables(config: Mapping[str, Any], source: str = "tokenizer_config.json") -> dict[str, str]:
    """The template variables transformers (5.x) passes from a tokenizer's special tokens.

    Its ``special_tokens_map``: ``bos_token``, ``eos_token``, ``unk_token``,
    ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``, plus the
    model-specific named tokens: any other top-level ``*_token`` key, and the
    entries of ``extra_special_tokens`` and ``model_specific_special_tokens``
    when those are objects (Gemma 3's ``image_token``, ``boi_token``, ...).
    Unset (null) tokens are left out, so the template sees them undefined; a
    list of ``additional_special_tokens`` is not passed, as in transformers 5.

    Args:
      config: the parsed ``tokenizer_config.json``.
      source: its name, for error messages.

    Raises:
      ValueError: a named special token that is neither a string nor ``{"content": str}``.
    """
    out: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        text = _token_text(config.get(key), f"{source} {key}")
        if text is not None:
            out[key] = text
    for key, value in config.items():  # model-specific tokens found by name
        if key.endswith("_token") and key not in _SPECIAL_TOKEN_KEYS and (
                isinstance(value, str) or (isinstance(value, Mapping) and isinstance(value.get("content"), str))):
            out[key] = _token_text(value, f"{source} {key}")
    for group in ("extra_special_tokens", "model_specific_special_tokens"):
        named = config.get(group)
        if isinstance(named, Mapping):
            for key, value in named.items():
                text = _token_text(value, f"{source} {group}.{key}")
                if text is not None:
                    out[key] = text
    return out


def template_from_tokenizer_config(config: Mapping[str, Any], source: str = "tokenizer_config.json",
                                   name: str | None = None) -> str | None:
    """``config["chat_template"]``: the string, or the named entry of a list of templates.

    Args:
      config: the parsed ``tokenizer_config.json``.
      source: its name, for error messages.
      name: which of several named templates; None: ``"default"``.

    Returns:
      The template text, or None when the config has none.

    Raises:
      ValueError: a list without that name (the message lists the names), or a
        field of another type.
    """
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        named = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{source} chat_template[{i}] must be an object with 'name' and "
                                 f"'template' strings")
            named[entry["name"]] = entry["template"]
        want = name or "default"
        if want not in named:
            raise ValueError(f"{source} has chat templates named {sorted(named)} and none named "
                             f"{want!r}; pass one with --chat-template FILE")
        return named[want]
    raise ValueError(f"{source} chat_template must be a string or a list of named templates, "
                     f"got {type(value).__name__}")


def load_checkpoint_chat_template(directory: str | os.PathLike) -> JinjaChatTemplate | None:
    """A Hugging Face checkpoint directory's chat template, with its special tokens.

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s
    ``chat_template`` (transformers loads it the same way); the variables come
    from ``tokenizer_config.json`` (:func:`special_token_variables`) when it exists.

    Returns:
      The compiled template, or None when the directory carries none.

    Raises:
      ValueError: ``tokenizer_config.json`` is not valid JSON or its fields are
        malformed, or the template does not parse (the message names the file).
    """
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config: Mapping[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from None
        if not isinstance(config, Mapping):
            raise ValueError(f"{config_path} must hold a JSON object")
    variables = special_token_variables(config, str(config_path))
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        return JinjaChatTemplate(jinja_path.read_text(encoding="utf-8"), variables, name=str(jinja_path))
    text = template_from_tokenizer_config(config, str(config_path))
    if text is None:
        return None
    return JinjaChatTemplate(text, variables, name=f"{config_path} chat_template")


def load_gguf_chat_template(path: str | os.PathLike,
                            metadata: Mapping[str, Any] | None = None) -> JinjaChatTemplate | None:
    """A GGUF file's ``tokenizer.chat_template``, with ``bos_token``/``eos_token`` from its vocabulary.

    Args:
      path: the GGUF file.
      metadata: its metadata (:func:`model.gguf_metadata.read_gguf_header`), if already read.

    Returns:
      The compiled template, or None when the file carries none.

    Raises:
      ValueError: the template does not parse, or a special-token id is outside the vocabulary.
    """
    if metadata is None:
        from model.gguf_metadata import read_gguf_header

        metadata = read_gguf_header(path).metadata
    text = metadata.get("tokenizer.chat_template")
    if text is None:
        return None
    variables: dict[str, Any] = {}
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    for var, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                     ("unk_token", "tokenizer.ggml.unknown_token_id"),
                     ("pad_token", "tokenizer.ggml.padding_token_id")):
        value = metadata.get(key)
        if value is None or not tokens:
            continue
        i = int(value)
        if not 0 <= i < len(tokens):
            raise ValueError(f"{Path(path).name}: {key}={i} is outside the vocabulary of {len(tokens)} tokens")
        variables[var] = tokens[i]
    return JinjaChatTemplate(text, variables, name=f"{Path(path).name} tokenizer.chat_template")


def read_chat_template_file(path: str | os.PathLike, variables: Mapping[str, Any] | None = None) -> JinjaChatTemplate:
    """A ``--chat-template FILE``: Jinja text, or JSON with a ``chat_template`` field
    (a ``tokenizer_config.json`` or a processor's ``chat_template.json``).

    Args:
      path: the file.
      variables: the served tokenizer's special tokens as template variables.

    Raises:
      ValueError: the file is missing or unreadable, its JSON has no
        ``chat_template``, or the template does not parse (each names the file).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template file {path}: {e}") from None
    if path.suffix == ".json":
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"chat template file {path} is not valid JSON: {e}") from None
        template = template_from_tokenizer_config(config, str(path)) if isinstance(config, Mapping) else None
        if template is None:
            raise ValueError(f"chat template file {path} has no 'chat_template' field")
        text = template
    if not text.strip():
        raise ValueError(f"chat template file {path} is empty")
    return JinjaChatTemplate(text, variables, name=str(path))


def pick_chat_template(override_file: str | os.PathLike | None, checkpoint_template: JinjaChatTemplate | None,
                       variables: Mapping[str, Any] | None = None) -> JinjaChatTemplate | None:
    """The template to serve: ``--chat-template FILE`` > the checkpoint's own > None (Gemma's).

    Args:
      override_file: the ``--chat-template`` file, or None.
      checkpoint_template: the model's own template (:func:`load_checkpoint_chat_template`,
        :func:`load_gguf_chat_template`), or None.
      variables: the special-token variables for an override file; by default
        the checkpoint template's.

    Returns:
      A template, or None: serve ``model.chat_template``'s Gemma 3 format.

    Raises:
      ValueError: as :func:`read_chat_template_file`.
    """
    if override_file is not None:
        if variables is None and checkpoint_template is not None:
            variables = checkpoint_template.variables
        return read_chat_template_file(override_file, variables)
    return checkpoint_template


class TemplatedTokenizer:
    """A tokenizer whose ``apply_chat_template`` renders a Jinja template (see ``model.jinja_chat_template``).

    Everything else (``encode``, ``decode``, ``bos_id``, ``stop_token_ids``, ...)
    is the wrapped tokenizer's.

    Args:
      tokenizer: a ``TextTokenizer`` that also has ``encode_markup`` (a
        ``MarkupTokenizer``), e.g. ``model.tokenizer.Tokenizer``.
      template: the chat template.
    """

    def __init__(self, tokenizer: Any, template: JinjaChatTemplate):
        if not callable(getattr(tokenizer, "encode_markup", None)):
            raise ValueError(f"{type(tokenizer).__name__} has no encode_markup, so a Jinja chat "
                             f"template cannot be encoded with it")
        self._tokenizer = tokenizer
        self.chat_template = template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The template's prompt ids for ``messages`` and ``tools``, with the generation prompt.

        Raises:
          ValueError: the template refuses the messages (see ``JinjaChatTemplate.encode``).
        """
        return self.chat_template.encode(messages, self._tokenizer, tools=tools)

    def __repr__(self) -> str:
        return f"TemplatedTokenizer({self._tokenizer!r}, {self.chat_template!r})"
