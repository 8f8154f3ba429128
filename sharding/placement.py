"""NamedShardings for a model's parameters, its KV cache and the step's small arrays.

Derived from the logical axes the model puts on its parameters
(``nnx.Param(..., logical_axes=...)``) and on the KV cache
(``sharding.rules.KV_CACHE_AXES``) through :class:`sharding.rules.ShardingRules`.
Placing never materialises a full copy per device: arrays are put shard by
shard (``jax.device_put`` with a NamedSharding), and the KV cache is created
directly in its sharding by a jitted ``zeros``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.lora import stack_axes
from sharding.rules import KV_CACHE_AXES, ShardingRules


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> dict[str, NamedSharding]:
    """``{flat name: NamedSharding}`` for every parameter of an NNX state (real or abstract).

    Raises:
      ValueError: a parameter without logical axes, or one the mesh cannot split (see rules).
    """
    out = {}
    for path, v in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        axes = v.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"parameter {name} has no logical_axes; the model must name them")
        out[name] = NamedSharding(mesh, rules.spec(v.get_value().shape, axes, dict(mesh.shape), what=name))
    return out


def _host_view(x):
    """``x`` as a numpy view when it is a jax.Array held whole in host memory (one CPU device),
    else ``x``. ``jax.device_put`` slices a numpy array's shards on the host; a device array it
    slices with a compiled program per shape and sharding (JAX's ``_multi_slice``), which cost
    a compile per weight shape whenever weights built on the host platform are placed."""
    if isinstance(x, jax.Array) and x.is_fully_addressable and len(x.devices()) == 1:
        (device,) = x.devices()
        if device.platform == "cpu":
            return np.asarray(x)
    return x


def place_tree(tree, shardings):
    """``jax.device_put(tree, shardings)`` with host-held leaves sliced on the host (see
    ``_host_view``): a pytree of arrays and a matching pytree (or one) of NamedShardings."""
    return jax.device_put(jax.tree.map(_host_view, tree), shardings)


def place_params(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """The state with every parameter put on ``mesh`` in its NamedSharding (shard by shard)."""
    shardings = param_shardings(state, mesh, rules)
    flat = nnx.to_flat_state(state)
    placed = []
    for path, v in flat:
        name = ".".join(map(str, path))
        placed.append((path, v.replace(jax.device_put(_host_view(v.get_value()), shardings[name]))))
    return nnx.from_flat_state(placed)


def lora_shardings(stacks: dict, cfg, mesh: Mesh, rules: ShardingRules) -> dict:
    """``{param: (a's NamedSharding, b's)}`` for LoRA stacks (``model.lora``) on ``mesh``: by
    ``model.lora.stack_axes``, features folded from heads split only in whole heads (a "heads"
    or "kv_heads" dimension is checked as ``cfg``'s head count: Gemma 3 270M's one KV head
    leaves k/v's b replicated, as its K/V projections are).

    Raises:
      ValueError: a mesh axis that does not divide what it would split (as for the weights).
    """
    heads = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}
    sizes = dict(mesh.shape)
    out = {}
    for p, arrays in stacks.items():
        pair = []
        for arr, axes in zip(arrays, stack_axes(p)):
            counted = tuple(heads.get(ax, d) for d, ax in zip(arr.shape, axes))
            pair.append(NamedSharding(mesh, rules.spec(counted, axes, sizes, what=f"LoRA stack {p}")))
        out[p] = tuple(pair)
    return out


def kv_cache_sharding(shape: tuple[int, ...], mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    """The KV cache ``[layers, kv_heads, num_pages, page_size, head_dim]``: kv heads over
    tensor where they divide it (else replicated), pages over data (each replica
    holds its share of the pool)."""
    return NamedSharding(mesh, rules.spec(shape, KV_CACHE_AXES, dict(mesh.shape), what="KV cache"))


def kv_scale_sharding(kv_sharding: NamedSharding) -> NamedSharding:
    """The scale pages ``[layers, kv_heads, num_pages, page_size]`` of a quantized KV cache
    split as its values (``kv_sharding``, whose head_dim is never split).

    Raises:
      ValueError: a values sharding that splits head_dim.
    """
    spec = tuple(kv_sharding.spec) + (None,) * (5 - len(kv_sharding.spec))
    if spec[4] is not None:
        raise ValueError(f"a quantized KV cache cannot split head_dim (spec {spec})")
    return NamedSharding(kv_sharding.mesh, P(*spec[:4]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def sharded_zeros(shape: tuple[int, ...], dtype, sharding: NamedSharding) -> jax.Array:
    """Zeros created in place on their shards (no full host or single-device copy)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def abstract_targets(layout: dict[str, tuple], mesh: Mesh | None, rules: ShardingRules
                     ) -> dict[str, jax.ShapeDtypeStruct]:
    """``{name: ShapeDtypeStruct(shape, dtype, sharding)}`` for a parameter layout
    ``{name: (shape, dtype, logical axes)}`` (``model.factory.abstract_params``):
    the restore target of a checkpoint on ``mesh`` (None: JAX's first device)."""
    out = {}
    for name, (shape, dtype, axes) in layout.items():
        if mesh is None:
            sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            sh = NamedSharding(mesh, rules.spec(shape, axes, dict(mesh.shape), what=name))
        out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    return out
