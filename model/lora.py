"""Many LoRA adapters in one batch: the stacked device buffers and the per-row update.

The adapters resident on the device share one static stack per adapted projection
(``p`` in :data:`model.lora_adapter.TARGETS`'s values: wq, wk, wv, wo, w_gate, w_up, w_down)::

    a[p]: [L, S, in, R]     S = max_loras + 1 slots; slot 0 is all zeros (the base model)
    b[p]: [L, S, R, out]    R = max_lora_rank; a rank-r adapter fills the first r of R
                            (the rest zero), and its scaling (alpha / r, rsLoRA alpha / sqrt r)
                            is folded into b

and every token of a step carries the slot of its row's adapter (``token_slots [T]
int32``, 0 for the base model), so one compiled step serves any mix of adapters
and base requests: a projection's output is ``x W + (x a[slot]) b[slot]`` row by row
(as S-LoRA / Punica batch heterogeneous adapters: Sheng et al. 2023, "S-LoRA:
Serving Thousands of Concurrent LoRA Adapters"; Chen et al. 2023, "Punica:
Multi-Tenant LoRA Serving"). The stacks are written outside ``jit``, one slot at a
time (:func:`write_slot`), by the engine's adapter registry.

How the per-row update is computed is the platform's choice (``Compute.lora``, set
by the engine's backend policy), with the same result:

  * "onehot": two dense dots over all slots, ``(x @ a_all) * onehot(slot) @ b_all``
    with ``a_all: [in, S * R]``, ``b_all: [S * R, out]`` (cheap while S * R is small
    next to the layer's width; zero slots add exact zeros);
  * "gather": each token's own ``a[slot]``, ``b[slot]`` gathered ([T, in, R], [T, R, out])
    and contracted per token (for many slots).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.lora_adapter import TARGETS, LoraAdapter, target_dims

LORA_FORMULATIONS = ("onehot", "gather")
PARAMS = tuple(TARGETS.values())
"""Every projection a stack holds, in order."""

_FEATURE_AXES = {"wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
                 "wo": ("heads", "embed"), "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"),
                 "w_down": ("mlp", "embed")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraInputs:
    """What a decoder's ``__call__`` needs to apply the resident adapters.

    Attributes:
      weights: {param: (a [L, S, in, R], b [L, S, R, out])} the stacks (see the module docstring).
      token_slots: [T] int32, each token's adapter slot (0: none).
    """

    weights: dict
    token_slots: jax.Array


def stack_shapes(cfg: ModelConfig, max_loras: int, max_rank: int) -> dict[str, tuple[tuple, tuple]]:
    """{param: (a shape [L, S, in, R], b shape [L, S, R, out])} for ``max_loras`` adapters of
    rank <= ``max_rank`` on ``cfg``'s decoder."""
    L, S, R = cfg.num_layers, max_loras + 1, max_rank
    out = {}
    for p in PARAMS:
        d_in, d_out = target_dims(cfg, p)
        out[p] = ((L, S, d_in, R), (L, S, R, d_out))
    return out


def stack_axes(param: str) -> tuple[tuple, tuple]:
    """The logical axes of ``param``'s stacks, (a's, b's): ``a [L, S, in, R]``, ``b [L, S, R, out]``,
    with ``in`` and ``out`` named as the adapted projection's own input and output features
    (heads folded into them: "heads" / "kv_heads" for N x H / K x H features, "mlp", "embed").

    Sharded by ``sharding.rules`` as the projection is: a column-parallel projection's
    (q/k/v/gate/up, output features split over ``tensor``) b is split over its output and its
    a replicated; a row-parallel one's (o/down, input features split) a is split over its
    input and its b replicated, so each device's partial ``(x a) b`` joins the projection's
    own reduction. Folded head features split in whole heads (``sharding.placement.lora_shardings``).
    """
    i, o = _FEATURE_AXES[param]
    return ("layers", None, i, None), ("layers", None, None, o)


def zero_stacks(cfg: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32) -> dict:
    """All-zero stacks (every slot the base model) in ``dtype``."""
    return {p: (jnp.zeros(a, dtype), jnp.zeros(b, dtype))
            for p, (a, b) in stack_shapes(cfg, max_loras, max_rank).items()}


def slot_weights(adapter: LoraAdapter | None, cfg: ModelConfig, max_rank: int) -> dict:
    """One slot's contents on the host: {param: (a [L, in, R], b [L, R, out]) float32}, the
    adapter's rank zero-padded to ``max_rank`` and its scaling folded into b; zeros for a
    projection it does not adapt (and for ``adapter`` None: an emptied slot).

    Raises:
      ValueError: the adapter's rank is above ``max_rank``.
    """
    if adapter is not None and adapter.rank > max_rank:
        raise ValueError(f"adapter rank {adapter.rank} is above max_lora_rank {max_rank}")
    L, out = cfg.num_layers, {}
    for p in PARAMS:
        d_in, d_out = target_dims(cfg, p)
        a = np.zeros((L, d_in, max_rank), np.float32)
        b = np.zeros((L, max_rank, d_out), np.float32)
        if adapter is not None and p in adapter.weights:
            wa, wb = adapter.weights[p]
            a[:, :, :adapter.rank] = wa
            b[:, :adapter.rank, :] = wb * np.float32(adapter.scaling)
        out[p] = (a, b)
    return out


@functools.partial(jax.jit, donate_argnums=(0,))
def _write(stacks: dict, slot: jax.Array, contents: dict) -> dict:
    return {p: (a.at[:, slot].set(contents[p][0].astype(a.dtype)),
                b.at[:, slot].set(contents[p][1].astype(b.dtype))) for p, (a, b) in stacks.items()}


def write_slot(stacks: dict, slot: int, contents: dict) -> dict:
    """The stacks with slot ``slot`` (1..S-1) replaced by ``contents`` (:func:`slot_weights`);
    the old stacks are donated. Runs outside the steps (one small jitted update)."""
    if not 1 <= slot < next(iter(stacks.values()))[0].shape[1]:
        raise ValueError(f"LoRA slot {slot} is out of range (slot 0 is the base model's)")
    return _write(stacks, jnp.asarray(slot, jnp.int32), contents)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array, dtype,
               formulation: str = "onehot") -> jax.Array:
    """Each token's LoRA update ``(x[t] @ a[slot[t]]) @ b[slot[t]]``.

    Args:
      x: [T, in] the projection's input (any float dtype; cast to ``dtype``).
      a: [S, in, R], b: [S, R, out]: one layer's stacks (scaling folded into b).
      token_slots: [T] int32 slots in 0..S-1.
      dtype: the matmul-input dtype; accumulation is float32.
      formulation: "onehot" or "gather" (see the module docstring).

    Returns:
      [T, out] float32.
    """
    S, d_in, R = a.shape
    x = x.astype(dtype)
    if formulation == "gather":
        xa = jnp.einsum("ti,tir->tr", x, a[token_slots].astype(dtype), preferred_element_type=jnp.float32)
        return jnp.einsum("tr,tro->to", xa.astype(dtype), b[token_slots].astype(dtype),
                          preferred_element_type=jnp.float32)
    if formulation != "onehot":
        raise ValueError(f"LoRA formulation must be one of {LORA_FORMULATIONS}, got {formulation!r}")
    a_all = jnp.transpose(a, (1, 0, 2)).reshape(d_in, S * R).astype(dtype)
    xa = jnp.einsum("ti,ir->tr", x, a_all, preferred_element_type=jnp.float32)  # [T, S * R]
    mask = jnp.repeat(jax.nn.one_hot(token_slots, S, dtype=jnp.float32), R, axis=1)
    return jnp.einsum("tr,ro->to", (xa * mask).astype(dtype), b.reshape(S * R, -1).astype(dtype),
                      preferred_element_type=jnp.float32)
