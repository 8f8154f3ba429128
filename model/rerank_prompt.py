"""A decoder reranker's prompt and label tokens (Qwen3-Reranker's recipe by default).

A decoder scores a (query, document) pair by the logits of two label tokens after a prompt::

    ids = markup(prefix) + text(body with {instruction}, {query}, {document} filled) + markup(suffix)
    score = softmax([logit("no"), logit("yes")])[1]      at the last position (model.score_heads)

``prefix`` and ``suffix`` are the template's own markup (special-token spellings become their ids,
``encode_markup``); the filled body is user text (``encode``: a query spelling ``<|im_end|>`` stays
those characters), tokenized whole as Qwen3-Reranker's model card tokenizes it. A template file
(``serve --rerank-template PATH``) is JSON with any of ``prefix``, ``body``, ``suffix``,
``instruction`` and ``labels`` (two token spellings, the negative first); what it leaves out keeps
Qwen3-Reranker's. This module must not import JAX: the gateway calls :meth:`RerankPrompt.encode_pair`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

__all__ = ["QWEN3_RERANKER", "RerankPrompt", "RerankTemplate"]

_FIELD = re.compile(r"\{(instruction|query|document)\}")


@dataclasses.dataclass(frozen=True)
class RerankTemplate:
    """The texts of a decoder reranker's prompt and its two label tokens (negative, positive)."""

    prefix: str
    body: str
    suffix: str
    instruction: str
    labels: tuple[str, str]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "RerankTemplate":
        """Qwen3-Reranker's template with what the JSON file at ``path`` overrides.

        Raises:
          ValueError: not a JSON object, unknown keys, values that are not strings, or
            ``labels`` not two strings.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--rerank-template {path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--rerank-template {path}: expected a JSON object")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"--rerank-template {path}: unknown keys {sorted(unknown)}")
        labels = data.pop("labels", None)
        if labels is not None and (not isinstance(labels, list) or len(labels) != 2
                                   or not all(isinstance(x, str) and x for x in labels)):
            raise ValueError(f"--rerank-template {path}: 'labels' must be two token spellings, negative first")
        if not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"--rerank-template {path}: prefix, body, suffix and instruction must be strings")
        return dataclasses.replace(QWEN3_RERANKER, **data, **({"labels": tuple(labels)} if labels else {}))


QWEN3_RERANKER = RerankTemplate(
    prefix=("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
            "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"),
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query",
    labels=("no", "yes"))
"""Qwen3-Reranker's prompt (its model card) and label tokens."""


class RerankPrompt:
    """A template bound to a tokenizer (``model.bpe_tokenizer.BPETokenizer``: ``encode``,
    ``encode_markup`` and ``backend.token_to_id``).

    Raises:
      ValueError: a label that is not one token of the vocabulary.
    """

    def __init__(self, template: RerankTemplate, tokenizer):
        self.template = template
        self.tokenizer = tokenizer
        self.prefix_ids = tokenizer.encode_markup(template.prefix)
        self.suffix_ids = tokenizer.encode_markup(template.suffix)
        ids = []
        for label in template.labels:
            i = tokenizer.backend.token_to_id(label)
            if i is None:
                raise ValueError(f"rerank label {label!r} is not one token of this model's vocabulary")
            ids.append(int(i))
        self.label_ids: tuple[int, int] = (ids[0], ids[1])

    def encode_pair(self, query: str, document: str) -> tuple[list[int], int]:
        """The prompt's token ids for one pair, and ``len(ids)`` (a decoder has one token type).

        Raises:
          TypeError: either text is not a ``str``.
        """
        if not isinstance(query, str) or not isinstance(document, str):
            raise TypeError("encode_pair expects two str")
        values = {"instruction": self.template.instruction, "query": query, "document": document}
        body = _FIELD.sub(lambda m: values[m.group(1)], self.template.body)
        ids = self.prefix_ids + self.tokenizer.encode(body) + self.suffix_ids
        return ids, len(ids)
