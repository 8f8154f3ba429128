"""What turns an encoder's hidden states into one relevance score per input (rerank / score).

Both heads have the embedding head's call shape (``model.sentence_transformers.EmbeddingHead``:
``(hidden [B, S, D] f32, lengths [B] int32) -> [B, dim] f32``, weights as trace constants), with
``dim == 1``, so the embedding engine runs them unchanged:

  * :class:`ClassifierHead`: a sequence-classification cross-encoder's (BERT's pooler then
    classifier, RoBERTa's ``classifier.dense -> tanh -> out_proj``: the same computation) on the
    first token, then sentence-transformers' activation (Sigmoid by default for one label);
  * :class:`LabelTokenHead`: a decoder reranker's (Qwen3-Reranker's recipe): the output head's
    logits of two label tokens at the last real token, ``softmax([no, yes])[1]``, i.e.
    ``sigmoid(logit_yes - logit_no)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ClassifierHead", "LabelTokenHead", "SCORE_ACTIVATIONS"]

SCORE_ACTIVATIONS = {"Sigmoid": jax.nn.sigmoid, "Identity": lambda x: x, "Tanh": jnp.tanh}
"""sentence-transformers CrossEncoder ``activation_fn`` class names this server applies."""


@dataclasses.dataclass(frozen=True, eq=False)
class ClassifierHead:
    """``act(out_w @ tanh(dense_w @ h[:, 0] + dense_b) + out_b)``.

    Attributes:
      dense_w: [D, D] f32 ([out, in]); dense_b: [D] f32.
      out_w: [1, D] f32; out_b: [1] f32.
      activation: a key of ``SCORE_ACTIVATIONS``.
      max_seq_length: the longest input the model takes (None: the encoder's).
    """

    dense_w: np.ndarray
    dense_b: np.ndarray
    out_w: np.ndarray
    out_b: np.ndarray
    activation: str = "Sigmoid"
    max_seq_length: int | None = None

    dim = 1

    def __call__(self, hidden: jax.Array, lengths: jax.Array) -> jax.Array:
        """hidden: [B, S, D] f32; lengths: [B] int32 -> scores [B, 1] f32."""
        x = jnp.tanh(jnp.einsum("bi,oi->bo", hidden[:, 0], jnp.asarray(self.dense_w), precision="highest")
                     + jnp.asarray(self.dense_b))
        logits = jnp.einsum("bi,oi->bo", x, jnp.asarray(self.out_w), precision="highest") + jnp.asarray(self.out_b)
        return SCORE_ACTIVATIONS[self.activation](logits)


@dataclasses.dataclass(frozen=True, eq=False)
class LabelTokenHead:
    """``softmax(h[b, len-1] @ label_w.T)[1]`` (after the model's final logit soft-cap, if any).

    Attributes:
      label_w: [2, D] f32, the output head's rows of the "no" and "yes" tokens, in that order.
      label_ids: the two token ids (reported in logs).
      soft_cap: the model's final logit soft-cap (None: off).
      max_seq_length: None (the decoder's context).
    """

    label_w: np.ndarray
    label_ids: tuple[int, int]
    soft_cap: float | None = None
    max_seq_length: int | None = None

    dim = 1

    def __call__(self, hidden: jax.Array, lengths: jax.Array) -> jax.Array:
        """hidden: [B, S, D] f32 final-norm states; lengths: [B] int32 -> scores [B, 1] f32 in (0, 1)."""
        last = hidden[jnp.arange(hidden.shape[0]), lengths - 1]
        logits = jnp.einsum("bd,ld->bl", last, jnp.asarray(self.label_w), precision="highest")
        if self.soft_cap is not None:
            logits = self.soft_cap * jnp.tanh(logits / self.soft_cap)
        return jax.nn.softmax(logits, axis=-1)[:, 1:]
