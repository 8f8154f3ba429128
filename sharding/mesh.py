"""Device meshes from config: ``mesh: {data: D, tensor: T, expert: E}``.

The mesh has three named axes, always in this order (outermost first)::

    data    independent model replicas; each owns a share of the slots and KV pages
    tensor  tensor (Megatron-style) parallelism: heads, MLP columns, vocabulary
    expert  expert parallelism: an MoE layer's experts, with all-to-all token dispatch

Devices are laid out ``data x tensor x expert`` in that order, so on real
hardware (``mesh_utils.create_device_mesh``) the inner axes get the closest
devices: tensor- and expert-parallel collectives run every layer, data
replicas never talk. An axis of size 1 costs nothing, so every mesh has all three
names and model code never has to ask whether an axis exists.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "tensor", "expert")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (devices along each axis).

    Attributes:
      data: replicas (slots and KV pages are split between them).
      tensor: tensor-parallel degree.
      expert: expert-parallel degree.
    """

    data: int = 1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh axis {name!r} must be a positive integer, got {v!r}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.tensor, self.expert)

    @property
    def size(self) -> int:
        return self.data * self.tensor * self.expert

    def axis_sizes(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, self.shape))

    def __str__(self) -> str:
        return f"data={self.data},tensor={self.tensor},expert={self.expert}"

    @classmethod
    def from_dict(cls, d: Mapping[str, int] | None) -> "MeshConfig":
        """``{data: D, tensor: T, expert: E}`` (missing axes are 1). Raises ValueError on unknown axes."""
        d = dict(d or {})
        unknown = set(d) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; the mesh axes are {list(MESH_AXES)}")
        return cls(**{k: int(v) for k, v in d.items()})

    @classmethod
    def parse(cls, text: str | None) -> "MeshConfig":
        """Parses ``"data=1,tensor=4,expert=1"`` (any subset, any order; "" means 1x1x1).

        Raises:
          ValueError: malformed text or unknown axis.
        """
        d: dict[str, int] = {}
        for part in (text or "").split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep or not value.strip().isdigit():
                raise ValueError(f"mesh must look like 'data=1,tensor=4,expert=1', got {text!r}")
            d[name.strip()] = int(value)
        return cls.from_dict(d)


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data x tensor x expert`` mesh over ``devices`` (default: all of JAX's devices,
    across every process after ``jax.distributed.initialize``).

    The mesh may use fewer devices than are present (a 1x4x1 mesh on 8 devices
    takes the first 4), so one process can compare meshes; it may not use more.

    Raises:
      ValueError: the mesh needs more devices than there are.
    """
    devices = list(jax.devices() if devices is None else devices)
    if cfg.size > len(devices):
        raise ValueError(
            f"mesh {cfg} needs {cfg.size} devices (data x tensor x expert = "
            f"{' x '.join(map(str, cfg.shape))}), but only {len(devices)} "
            f"{devices[0].platform.upper() if devices else ''} device(s) are present"
            + ("; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices"
               if devices and devices[0].platform == "cpu" else ""))
    if cfg.size == len(devices) and len(devices) > 1:
        try:  # topology-aware order on real hardware (ICI rings on TPU)
            from jax.experimental import mesh_utils

            grid = mesh_utils.create_device_mesh(cfg.shape, devices=devices)
        except Exception:  # noqa: BLE001 - unknown topologies fall back to plain order
            grid = np.asarray(devices).reshape(cfg.shape)
    else:
        grid = np.asarray(devices[:cfg.size]).reshape(cfg.shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
