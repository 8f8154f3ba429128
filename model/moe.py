"""Mixture-of-experts feed-forward: top-k router, stacked experts, dropless grouped matmul.

Mixtral / Qwen3-MoE style (Jiang et al. 2024, "Mixtral of Experts"; the Qwen3
report): each token picks its top-k experts from a linear router, the k
weights are the softmax over those k logits (equal to renormalised top-k
softmax probabilities, Qwen3's ``norm_topk_prob``), and the output is the
weighted sum of the chosen experts' SwiGLU MLPs::

    logits = x @ router                       router: [D, E]
    w, e   = softmax(top_k(logits, k))        w, e: [T, k]
    y_t    = sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t))

Experts are stored stacked ``w_gate, w_up: [E, D, F]``, ``w_down: [E, F, D]``.
Two dropless implementations of the expert matmuls (``impl``):

  * "ragged": token-expert assignments sorted by expert and multiplied with
    ``jax.lax.ragged_dot`` (MegaBlocks' grouped GEMM, Gale et al. 2022): work
    follows the k assignments per token.
  * "capacity": a dense one-hot dispatch into per-expert buffers of capacity T
    (GShard's einsum formulation with capacity = T, so nothing is dropped):
    work is E x T rows whatever the routing.

"auto" chooses by the number of assignment rows: "capacity" up to
``MoEConfig.capacity_max_rows`` rows, "ragged" beyond. The threshold is the
backend policy's (``serving.engine.backend_policy``), measured with ``python -m
benchmarks.moe_dispatch`` (benchmarks/RESULTS.md "MoE expert matmuls"): where
``ragged_dot`` has no fast lowering, the capacity einsum wins at decode sizes
and loses once its E x T work grows; with the default threshold 0, "auto" is
"ragged".

Expert parallelism (``moe_ffn`` under a mesh whose ``expert`` or ``tensor``
axis is > 1) runs the layer in ``jax.shard_map``: tokens are split over the
data and expert axes, each device routes its own tokens, an all-to-all over
the expert axis sends every assignment to the device that owns its expert
(fixed-size buffers of T_local * k rows per destination, so no token is ever
dropped), the local experts run (their hidden columns split over the tensor
axis, partial outputs summed with psum), and a second all-to-all brings the
results back to be combined. Which mesh axes play these roles is the
caller's to say (``MoEConfig.expert_axis``, ``tensor_axis``, ``batch_axis``: the
engine reads them off its sharding rules for the logical axes "expert", "mlp"
and "batch").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.compute import MOE_IMPLS, REFERENCE, Compute, MoEConfig

__all__ = ["MOE_IMPLS", "MoEConfig", "grouped_ffn", "moe_ffn", "route"]


def route(x: jax.Array, router: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k routing.

    Args:
      x: [T, D] f32 (normed hidden states).
      router: [D, E].
      k: experts per token.

    Returns:
      (weights [T, k] f32 summing to 1 per token, experts [T, k] int32 in 0..E-1).
    """
    logits = jnp.einsum("td,de->te", x, router.astype(jnp.float32),
                        preferred_element_type=jnp.float32)
    top, experts = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)


def grouped_ffn(rows: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, dtype, impl: str = "ragged", compute: Compute = REFERENCE) -> jax.Array:
    """Each row through its expert's SwiGLU MLP.

    Args:
      rows: [R, D] f32.
      ids: [R] int32 expert of each row in 0..G-1; G (= w_gate.shape[0]) marks an
        empty row, whose output is 0.
      w_gate, w_up: [G, D, F]; w_down: [G, F, D].
      dtype: matmul-input dtype (accumulation is float32).
      impl: "auto", "ragged" or "capacity" (see the module docstring; "auto" uses
        ``compute.moe.capacity_max_rows``).
      compute: the dot of the capacity path and the "auto" threshold.

    Returns:
      [R, D] f32.

    Raises:
      ValueError: an unknown impl.
    """
    G = w_gate.shape[0]
    if impl == "auto":
        impl = "capacity" if rows.shape[0] <= compute.moe.capacity_max_rows else "ragged"
    valid = ids < G
    if impl == "ragged":
        order = jnp.argsort(ids, stable=True)  # empty rows (id G) sort last, outside every group
        xs = rows[order].astype(dtype)
        sizes = jnp.bincount(ids, length=G).astype(jnp.int32)

        def rdot(a, w):
            return jax.lax.ragged_dot(a.astype(dtype), w.astype(dtype), sizes,
                                      preferred_element_type=jnp.float32)

        h = jax.nn.silu(rdot(xs, w_gate)) * rdot(xs, w_up)
        ys = rdot(h, w_down)
        y = jnp.zeros_like(ys).at[order].set(ys)
    elif impl == "capacity":
        onehot = jax.nn.one_hot(ids, G, dtype=jnp.float32)  # [R, G]; empty rows are all zero
        pos = (jnp.cumsum(onehot, axis=0) - 1.0) * onehot  # row's slot in its expert's buffer
        dispatch = onehot[:, :, None] * jax.nn.one_hot(pos.sum(-1).astype(jnp.int32), rows.shape[0],
                                                       dtype=jnp.float32)[:, None, :]  # [R, G, C=R]
        xe = jnp.einsum("rgc,rd->gcd", dispatch, rows)  # [G, C, D]
        h = (jax.nn.silu(compute.dot("gcd,gdf->gcf", xe, w_gate, dtype))
             * compute.dot("gcd,gdf->gcf", xe, w_up, dtype))
        ye = compute.dot("gcf,gfd->gcd", h, w_down, dtype)
        y = jnp.einsum("rgc,gcd->rd", dispatch, ye)
    else:
        raise ValueError(f"moe impl must be one of {MOE_IMPLS}, got {impl!r}")
    return jnp.where(valid[:, None], y, 0.0)


def _moe_local(x, router, w_gate, w_up, w_down, *, k: int, dtype, impl: str, compute: Compute,
               expert_axis: str | None, tensor_axis: str | None) -> jax.Array:
    """The MoE layer on one device's tokens (inside shard_map, or alone without a mesh).

    x: [Tl, D] f32; router: [D, E]; w_gate, w_up: [El, D, Fl]; w_down: [El, Fl, D]
    (El = E / expert-axis size, Fl = F / tensor-axis size). Returns [Tl, D] f32.
    """
    n = jax.lax.axis_size(expert_axis) if expert_axis else 1
    local_experts = w_gate.shape[0]
    Tl, D = x.shape
    A = Tl * k  # assignments; also each destination buffer's capacity (dropless)
    weights, experts = route(x, router, k)
    flat_e = experts.reshape(A)
    dest = flat_e // local_experts  # the expert-axis index owning each assignment's expert
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=n)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.zeros(A, jnp.int32).at[order].set(
        (jnp.arange(A) - starts[dest[order]]).astype(jnp.int32))
    tok = jnp.arange(A) // k
    send_x = jnp.zeros((n, A, D), x.dtype).at[dest, pos].set(x[tok])
    send_e = jnp.full((n, A), local_experts, jnp.int32).at[dest, pos].set(flat_e % local_experts)
    if n > 1:  # dispatch: buffer j goes to expert shard j; we receive one buffer per source
        send_x = jax.lax.all_to_all(send_x, expert_axis, 0, 0, tiled=True)
        send_e = jax.lax.all_to_all(send_e, expert_axis, 0, 0, tiled=True)
    y = grouped_ffn(send_x.reshape(n * A, D), send_e.reshape(n * A), w_gate, w_up, w_down,
                    dtype, impl, compute)
    if tensor_axis:  # hidden columns were split: sum the partial down projections
        y = jax.lax.psum(y, tensor_axis)
    y = y.reshape(n, A, D)
    if n > 1:  # combine: results return to the shard that sent them, same slots
        y = jax.lax.all_to_all(y, expert_axis, 0, 0, tiled=True)
    y = y[dest, pos].reshape(Tl, k, D)
    return jnp.einsum("tkd,tk->td", y, weights)


def moe_ffn(x: jax.Array, p: dict, *, k: int, dtype, impl: str | None = None,
            compute: Compute = REFERENCE) -> jax.Array:
    """The MoE feed-forward of one layer; expert-parallel when a mesh is set.

    Args:
      x: [T, D] f32 normed hidden states.
      p: router [D, E]; w_gate, w_up [E, D, F]; w_down [E, F, D].
      k: top-k.
      dtype: matmul-input dtype.
      impl: "auto" | "ragged" | "capacity"; None: ``compute.moe.impl``.
      compute: the dot, the "auto" threshold and the mesh axes (``compute.moe``).

    Returns:
      [T, D] f32.

    Under ``jax.set_mesh(mesh)`` (the engine sets it) where ``compute.moe``'s
    expert or tensor axis has size > 1, the layer runs in ``jax.shard_map`` with
    all-to-all dispatch as described in the module docstring; T is padded to a
    multiple of the token-splitting axes.
    """
    cfg = compute.moe
    impl = impl or cfg.impl
    args = (x, p["router"], p["w_gate"], p["w_up"], p["w_down"])
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape) if not mesh.empty else {}
    expert_axis = cfg.expert_axis if sizes.get(cfg.expert_axis, 1) > 1 else None
    tensor_axis = cfg.tensor_axis if sizes.get(cfg.tensor_axis, 1) > 1 else None
    batch_axis = cfg.batch_axis
    local = functools.partial(_moe_local, k=k, dtype=dtype, impl=impl, compute=compute)
    if expert_axis is None and tensor_axis is None:
        return local(*args, expert_axis=None, tensor_axis=None)
    tok_axes = tuple(a for a in (batch_axis, expert_axis) if a and sizes.get(a, 1) > 1)
    split = 1
    for a in tok_axes:
        split *= sizes[a]
    T = x.shape[0]
    pad = -T % split
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    tok_spec = P(tok_axes or None, None)
    w_in = P(expert_axis, None, tensor_axis)
    fn = jax.shard_map(
        functools.partial(local, expert_axis=expert_axis, tensor_axis=tensor_axis),
        mesh=mesh,
        in_specs=(tok_spec, P(None, None), w_in, w_in, P(expert_axis, tensor_axis, None)),
        out_specs=tok_spec)
    return fn(x, *args[1:])[:T]
