"""What the gateway needs from a tokenizer: text <-> ids and the chat format.

`model.tokenizer.Tokenizer` (SentencePiece: Gemma's, and real ``.model`` files) and
`model.bpe_tokenizer.BPETokenizer` (``tokenizers``: Hugging Face, tiktoken and
GGUF byte-level BPE vocabularies) implement it; the gateway only sees this
protocol, so it never imports the model package's JAX code.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class TextTokenizer(Protocol):
    bos_id: int | None  # None: the model has no BOS token (Qwen)
    eos_id: int
    vocab_size: int

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation (e.g. Gemma's <eos> and <end_of_turn>)."""

    @property
    def chat_stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation in a chat: ``stop_token_ids`` plus the chat
        template's turn-opening control token(s) (Gemma's <start_of_turn>), so
        a model that opens the next turn itself ends its own."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Encode user text; control-token spellings stay plain text. ``add_bos``
        prepends the BOS id when the model uses one."""

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text; control tokens decode to the empty string."""

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Render chat messages ([{"role", "content", ...}]) and the tools the model may
        call (``[{"type": "function", "function": {...}}]``, or None) with the
        generation prompt.

        Raises:
          ValueError: unknown role, misplaced system message, or non-text content.
        """
