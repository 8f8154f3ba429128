"""Running a tiny Hugging Face checkpoint of tests/data/hf_tiny as its parity tests do, against
the transformers outputs recorded beside it (``golden.json``, ``logits.npy``, ``greedy_logits.npy``):
one prefill over the paged KV cache, then greedy decode steps reading the cache
(:func:`prefill_then_greedy`), and the near-tie rule for greedy ids (:func:`agree_until_near_tie`).
Shared by tests/model/test_hf_checkpoint.py, tests/model/test_qwen2_phi3_gemma2.py and
tests/serving/engine/test_engine_hf_tiny.py."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention_metadata import AttentionMetadata
from model.compute import REFERENCE, Compute
from model.kv_cache import KVCache
from model.lora import LoraInputs
from tests.support.paths import TEST_DATA

DATA = TEST_DATA / "hf_tiny"
PAGE = 8
ATOL = 1e-4


def golden(case: str) -> dict:
    return json.loads((DATA / case / "golden.json").read_text())


@functools.partial(jax.jit, static_argnums=(0, 7))
def _step(graphdef, state, tokens, positions, cache, md, logits_indices, compute=REFERENCE, lora=None,
          image_embeds=None):
    model = nnx.merge(graphdef, state)
    extra = {}
    if lora is not None:
        weights, slot = lora
        extra["lora"] = LoraInputs(weights, jnp.full(tokens.shape, slot, jnp.int32))
    if image_embeds is not None:
        extra["image_embeds"] = image_embeds
    return model(tokens, positions, cache, md, logits_indices, compute, **extra)


def prefill_then_greedy(model, prompt: list[int], new: int, compute: Compute = REFERENCE, lora=None, *,
                        image_embeds: np.ndarray | None = None, image_spans: np.ndarray | None = None
                        ) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(logits [T, V] at every prompt position, ``new`` greedy ids decoded through the cache,
    the logits [new, V] each id was chosen from), every step run with ``compute``; the prompt's
    image soft tokens ``image_embeds`` [T, D] at the tokens whose ``image_spans`` [T, 2] are
    not empty (Gemma 3's vision input, ``model.attention_metadata``).

    ``lora``: (LoRA stacks of ``model.lora``, the slot every token uses) or None."""
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    T = len(prompt)
    pages = -(-(T + new) // PAGE)
    table = np.arange(pages, 0, -1, dtype=np.int32)  # reversed: the page table is not the identity
    cache = KVCache.zeros(cfg, pages + 1, PAGE, jnp.float32)
    pos = np.arange(T, dtype=np.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(table[pos // PAGE] * PAGE + pos % PAGE),
                           page_table=jnp.asarray(table[None]), kv_lens=jnp.asarray([T], jnp.int32),
                           cu_q_lens=jnp.asarray([0, T], jnp.int32),
                           num_seqs=jnp.asarray(1, jnp.int32), mode="prefill",
                           image_spans=None if image_spans is None else jnp.asarray(image_spans, jnp.int32))
    with jax.default_matmul_precision("highest"):
        logits, cache = _step(graphdef, state, jnp.asarray(prompt, jnp.int32), jnp.asarray(pos),
                              cache, md, jnp.asarray(pos), compute, lora,
                              None if image_embeds is None else jnp.asarray(image_embeds, jnp.float32))
        logits = np.asarray(logits)
        rows = [logits[-1]]
        ids = [int(np.argmax(logits[-1]))]
        for p in range(T, T + new - 1):
            md = AttentionMetadata(
                slot_mapping=jnp.asarray([table[p // PAGE] * PAGE + p % PAGE], jnp.int32),
                page_table=jnp.asarray(table[None]), kv_lens=jnp.asarray([p + 1], jnp.int32),
                cu_q_lens=jnp.asarray([0, 1], jnp.int32), num_seqs=jnp.asarray(1, jnp.int32),
                mode="decode")
            step, cache = _step(graphdef, state, jnp.asarray([ids[-1]], jnp.int32),
                                jnp.asarray([p], jnp.int32), cache, md, jnp.asarray([0], jnp.int32),
                                compute, lora)
            rows.append(np.asarray(step)[0])
            ids.append(int(np.argmax(rows[-1])))
    return logits, ids, np.stack(rows)


def agree_until_near_tie(ours: list[int], ref: dict, what: str) -> int:
    """Greedy ids equal up to the first step whose margin < cutoff; returns the steps compared."""
    ids, margins = ref["greedy"]["ids"], ref["greedy"]["step_top1_top2_margin"]
    for step, (a, b) in enumerate(zip(ours, ids)):
        if margins[step] < ref["cutoff"]:
            return step
        assert a == b, f"{what}: step {step} gave {a}, transformers {b} (margin {margins[step]:.4f})"
    assert len(ours) == len(ids)
    return len(ids)
