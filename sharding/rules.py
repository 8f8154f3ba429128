"""Logical-axis rules: logical axis names -> mesh axes -> ``PartitionSpec``.

Models annotate every parameter with logical axes (``nnx.Param(...,
logical_axes=("layers", "embed", "heads", "head_dim"))``); the KV cache and a
few activations are named the same way. This module alone decides how those
names map onto the ``data x tensor x expert`` mesh (the scheme of flax's
``logical_to_mesh_axes``, MaxText and tpu-inference). The default table is
data: ``configs/sharding.yaml``.

A logical dimension is split over its mesh axis only when the axis size
divides it. For axes listed in ``replicate_if_indivisible`` (``kv_heads``) the
dimension is then replicated instead; for any other axis it is a
configuration error, reported with the parameter's name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec as P

from sharding.mesh import MESH_AXES


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None: replicated).

    Attributes:
      rules: tuple of (logical axis, mesh axis or None) pairs.
      replicate_if_indivisible: logical axes that fall back to replication when
        the mesh axis does not divide them (instead of raising).
    """

    rules: tuple[tuple[str, str | None], ...]
    replicate_if_indivisible: tuple[str, ...] = ("kv_heads",)

    def __post_init__(self):
        for logical, mesh_axis in self.rules:
            if mesh_axis is not None and mesh_axis not in MESH_AXES:
                raise ValueError(f"sharding rule {logical!r} -> {mesh_axis!r}: not a mesh axis "
                                 f"(one of {list(MESH_AXES)} or null)")

    @classmethod
    def from_dict(cls, d: Mapping) -> "ShardingRules":
        """From the YAML form ``{rules: {logical: mesh_axis|null}, replicate_if_indivisible: [...]}``."""
        return cls(tuple((str(k), v) for k, v in dict(d["rules"]).items()),
                   tuple(d.get("replicate_if_indivisible", ())))

    @classmethod
    def default(cls) -> "ShardingRules":
        """The table in ``configs/sharding.yaml``."""
        from importlib import resources

        import yaml

        return cls.from_dict(yaml.safe_load(resources.files("configs").joinpath("sharding.yaml").read_text()))

    def mesh_axis(self, logical: str | None) -> str | None:
        """The mesh axis a logical axis maps to (None: replicated or unknown)."""
        if logical is None:
            return None
        return dict(self.rules).get(logical)

    def spec(self, shape: Sequence[int], logical_axes: Sequence[str | None],
             axis_sizes: Mapping[str, int], what: str = "array") -> P:
        """The PartitionSpec of an array of ``shape`` named ``logical_axes``.

        Args:
          shape: the global shape.
          logical_axes: one name (or None) per dimension.
          axis_sizes: mesh axis name -> size (``Mesh.shape`` or ``MeshConfig.axis_sizes()``).
          what: the array's name, for error messages.

        Raises:
          ValueError: rank mismatch, a mesh axis used twice, or a mesh axis
            that does not divide its dimension (outside ``replicate_if_indivisible``).
        """
        if len(shape) != len(logical_axes):
            raise ValueError(f"{what}: shape {tuple(shape)} has {len(shape)} dims but "
                             f"{len(logical_axes)} logical axes {tuple(logical_axes)}")
        out: list[str | None] = []
        used: set[str] = set()
        for dim, logical in zip(shape, logical_axes):
            axis = self.mesh_axis(logical)
            size = axis_sizes.get(axis, 1) if axis else 1
            if axis is None or size == 1:
                out.append(None)
                continue
            if axis in used:
                raise ValueError(f"{what}: mesh axis {axis!r} would split two dimensions "
                                 f"(logical axes {tuple(logical_axes)})")
            if dim % size:
                if logical in self.replicate_if_indivisible:
                    out.append(None)
                    continue
                raise ValueError(
                    f"{what}: logical axis {logical!r} has size {dim}, which the mesh axis "
                    f"{axis!r} of size {size} does not divide; choose {axis}= a divisor of {dim}")
            used.add(axis)
            out.append(axis)
        return P(*out)

    def shard_shape(self, shape: Sequence[int], logical_axes: Sequence[str | None],
                    axis_sizes: Mapping[str, int], what: str = "array") -> tuple[int, ...]:
        """The per-device shape of such an array (no devices needed: used by shard-plan)."""
        spec = self.spec(shape, logical_axes, axis_sizes, what)
        return tuple(d // (axis_sizes[a] if a else 1)
                     for d, a in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))

    def shard_bytes(self, shape, logical_axes, axis_sizes, itemsize: int, what: str = "array") -> int:
        """Bytes of one device's shard."""
        return math.prod(self.shard_shape(shape, logical_axes, axis_sizes, what)) * itemsize


KV_CACHE_AXES = ("layers", "kv_heads", "pages", None, "head_dim")
"""Logical axes of the stacked KV cache ``[layers, kv_heads, num_pages, page_size, head_dim]``."""
