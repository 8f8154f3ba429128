"""One prefill step and one decode step of a model, optionally sharded on a mesh: their logits.

Mirrors what ``serving.engine.engine`` does (params and KV cache placed by
``sharding.placement``, the model called with its backend policy's
``Compute``, the step jitted with the cache's sharding and run under
``jax.set_mesh``), but returns logits instead of sampled tokens.
Every step is synchronised (``block_until_ready``) before the next one is
dispatched: see tests/sharding/test_sharding_multidevice.py on why.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model.attention_metadata import AttentionMetadata
from model.kv_cache import KVCache
from serving.engine.backend_policy import BackendPolicy

PAGE_SIZE = 8


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def run_steps(model, mesh=None, prompt_len: int = 21, rows: int = 4, moe_impl: str = "auto",
              cpu_kernels: str = "off") -> np.ndarray:
    """Prefills ``rows`` prompts (one prefill step each, chunked at 16 tokens), then one
    decode step over all rows (``cpu_kernels``: the policy's ``--cpu-kernels``). Returns the
    logits of every prefill step's last token and of the decode step: [2 * rows, vocab] f32
    numpy (the prefill rows first).
    """
    cfg = model.cfg
    policy = BackendPolicy.detect(mesh, moe_impl=moe_impl, cpu_kernels=cpu_kernels)
    graphdef, params = nnx.split(model)
    pages_per_seq = -(-(prompt_len + 1) // PAGE_SIZE)
    num_pages = 1 + rows * pages_per_seq
    num_pages += -num_pages % 8  # divisible by any data-axis size used in the tests
    shape = KVCache.shape(cfg, num_pages, PAGE_SIZE)
    if mesh is None:
        cache = KVCache.zeros(cfg, num_pages, PAGE_SIZE, jnp.float32)
        out_sh = None
        ctx = contextlib.nullcontext
        compute = policy.compute()
    else:
        from sharding.placement import kv_cache_sharding, place_params, sharded_zeros
        from sharding.rules import ShardingRules

        rules = ShardingRules.default()
        compute = policy.compute(rules)
        params = place_params(params, mesh, rules)
        kv_sh = kv_cache_sharding(shape, mesh, rules)
        cache = KVCache(sharded_zeros(shape, jnp.float32, kv_sh), sharded_zeros(shape, jnp.float32, kv_sh))
        # logits replicated: readable on every process of a multi-process mesh
        out_sh = (NamedSharding(mesh, P()), KVCache(kv_sh, kv_sh))

        def ctx():
            return jax.set_mesh(mesh)

    def step(params, cache, tokens, positions, md, li):
        return nnx.merge(graphdef, params)(tokens, positions, cache, md, li, compute=compute)

    fn = jax.jit(step, donate_argnums=(1,), out_shardings=out_sh)
    tables = [np.arange(1 + r * pages_per_seq, 1 + (r + 1) * pages_per_seq, dtype=np.int32)[::-1].copy()
              for r in range(rows)]
    prompts = [_prompt(cfg.vocab_size, prompt_len - r, seed=r) for r in range(rows)]
    out = []
    with ctx():
        for r in range(rows):
            ids, table = prompts[r], tables[r]
            for start in range(0, len(ids), 16):
                toks = ids[start:start + 16]
                T = 16
                positions = np.zeros(T, np.int32)
                positions[:len(toks)] = np.arange(start, start + len(toks))
                slot = table[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
                slot[len(toks):] = 0
                md = AttentionMetadata(
                    slot_mapping=slot.astype(np.int32), page_table=table[None],
                    kv_lens=np.asarray([start + len(toks)], np.int32),
                    cu_q_lens=np.asarray([0, len(toks)], np.int32),
                    num_seqs=np.asarray(1, np.int32), mode="prefill")
                logits, cache = fn(params, cache, np.pad(np.asarray(toks, np.int32), (0, T - len(toks))),
                                   positions, md, np.asarray([len(toks) - 1], np.int32))
                jax.block_until_ready((logits, cache))
            out.append(np.asarray(logits)[0])
        positions = np.asarray([len(p) for p in prompts], np.int32)
        tokens = np.asarray([p[-1] for p in prompts], np.int32)
        page_table = np.stack(tables)
        slot = page_table[np.arange(rows), positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        md = AttentionMetadata(slot_mapping=slot.astype(np.int32), page_table=page_table,
                               kv_lens=positions + 1, cu_q_lens=np.arange(rows + 1, dtype=np.int32),
                               num_seqs=np.asarray(rows, np.int32), mode="decode")
        logits, cache = fn(params, cache, tokens, positions, md, np.arange(rows, dtype=np.int32))
        jax.block_until_ready((logits, cache))
        out.extend(np.asarray(logits))
    return np.stack(out)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float, what: str) -> None:
    """max |got - want| <= rtol * max |want| (relative to the logits' scale)."""
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    assert err <= rtol * scale, f"{what}: max abs error {err:.3e} > {rtol} x max |logit| {scale:.3e}"
