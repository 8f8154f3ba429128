"""``shard-plan``: per-device memory and the decode step's memory-bound floor, before renting hardware.

For a model config, a mesh, a slot count and a context length:

  * parameter bytes per device: every parameter's shard under the logical-axis
    rules (``jax.eval_shape`` of the model, so the shapes are the real ones;
    replicated arrays count in full on every device). Equal to the sum of the
    per-device shard bytes of the real arrays (tests/sharding/multidevice/test_shard_plan.py).
  * KV-cache bytes per device: ``slots * ceil(max_len / page_size) + 1`` pages
    (the null page), pages split over ``data``, KV heads over ``tensor`` where
    they divide it; an int8 / fp8 ``kv_dtype`` counts 1-byte values plus a float32
    scale per token, KV head and layer (``--kv-cache-dtype``'s pages).
  * a working-set estimate: parameters + KV cache + the largest transients of
    the XLA reference path (one layer's gathered K/V for a full decode batch,
    a prefill chunk's attention scores over the whole context, the logits).
  * the decode floor: the bytes one decode step must read on each device
    (its parameter shard, for MoE only the experts a full batch can reach, and
    the KV cache of full-length sequences) over the device's memory bandwidth.
    Real steps are slower (compute, collectives, launch overhead); this is the
    bound that batching and sharding move.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from model.config import ModelConfig
from sharding.mesh import MeshConfig
from sharding.rules import KV_CACHE_AXES, ShardingRules

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator chip: memory (bytes) and peak memory bandwidth (bytes/s)."""

    name: str
    description: str
    memory_bytes: int
    bandwidth_bytes_per_s: float


def _config_file(name: str) -> dict:
    """The parsed ``configs/NAME`` (package data; the files shard-plan reads)."""
    from importlib import resources

    import yaml

    return yaml.safe_load(resources.files("configs").joinpath(name).read_text()) or {}


def known_devices() -> dict[str, DeviceSpec]:
    """The table in ``configs/devices.yaml``."""
    return {k: DeviceSpec(k, v["description"], int(v["memory_gib"] * GIB), float(v["bandwidth_gbps"]) * 1e9)
            for k, v in _config_file("devices.yaml").items()}


def device_spec(name: str) -> DeviceSpec:
    """Raises ValueError for an unknown device name."""
    devices = known_devices()
    if name.lower() not in devices:
        raise ValueError(f"unknown device {name!r}; known: {sorted(devices)} (configs/devices.yaml)")
    return devices[name.lower()]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Per-device numbers (bytes unless named otherwise)."""

    model: str
    mesh: MeshConfig
    device: DeviceSpec
    slots: int
    max_len: int
    param_bytes: int
    param_bytes_total: int
    kv_bytes: int
    kv_pages: int
    activation_bytes: int
    decode_read_bytes: int

    @property
    def working_set_bytes(self) -> int:
        return self.param_bytes + self.kv_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.working_set_bytes <= self.device.memory_bytes

    @property
    def decode_floor_s(self) -> float:
        return self.decode_read_bytes / self.device.bandwidth_bytes_per_s

    def table(self) -> str:
        """The human-readable report (GiB, milliseconds)."""
        g = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
        dev = self.device
        rows = [
            f"model {self.model} on mesh {self.mesh} ({self.mesh.size} x {dev.description}, "
            f"{dev.memory_bytes / GIB:.0f} GiB, {dev.bandwidth_bytes_per_s / 1e9:.0f} GB/s each)",
            f"slots {self.slots}, max length {self.max_len} tokens, {self.kv_pages} KV pages",
            "per device:",
            f"  parameters     {g(self.param_bytes)}   (all devices together {self.param_bytes_total / GIB:.2f} GiB)",
            f"  KV cache       {g(self.kv_bytes)}",
            f"  activations    {g(self.activation_bytes)}   (estimate)",
            f"  working set    {g(self.working_set_bytes)}   "
            f"{'fits' if self.fits else 'DOES NOT FIT'} in {dev.memory_bytes / GIB:.0f} GiB",
            f"decode floor     {self.decode_floor_s * 1e3:8.2f} ms per step (memory-bound: "
            f"{self.decode_read_bytes / GIB:.2f} GiB read per device), "
            f"<= {self.slots / self.decode_floor_s:,.0f} tokens/s at {self.slots} slots",
        ]
        return "\n".join(rows)


def param_bytes_per_device(cfg: ModelConfig, mesh: MeshConfig, rules: ShardingRules,
                           dtype: str = "bfloat16") -> tuple[int, int, dict[str, int]]:
    """(bytes on one device, bytes summed over all devices, {param: bytes on one device}).

    Every device holds the same amount: each rule splits a dimension evenly.
    """
    from model.factory import abstract_params

    sizes = mesh.axis_sizes()
    per = {}
    total = 0
    for name, (shape, dt, axes) in abstract_params(cfg, dtype).items():
        per[name] = rules.shard_bytes(shape, axes, sizes, jnp.dtype(dt).itemsize, what=name)
        total += per[name] * mesh.size
    return sum(per.values()), total, per


def plan(cfg: ModelConfig, mesh: MeshConfig, device: DeviceSpec, *, slots: int = 32,
         max_len: int | None = None, page_size: int = 16, prefill_chunk: int = 512,
         dtype: str = "bfloat16", kv_dtype: str | None = None,
         rules: ShardingRules | None = None) -> ShardPlan:
    """Computes the plan (see the module docstring).

    Raises:
      ValueError: the mesh cannot split the model (e.g. tensor does not divide
        the heads), or the slots do not split over ``data``.
    """
    rules = rules or ShardingRules.default()
    max_len = min(max_len or cfg.max_position, cfg.max_position)
    if slots % mesh.data:
        raise ValueError(f"slots ({slots}) must split evenly over data={mesh.data} replicas")
    sizes = mesh.axis_sizes()
    p_bytes, p_total, per_param = param_bytes_per_device(cfg, mesh, rules, dtype)
    kv_fmt = kv_dtype or dtype
    quantized = kv_fmt in ("int8", "fp8")  # 1-byte values + a float32 scale per token and KV head
    kv_item = 1 if quantized else jnp.dtype(kv_fmt).itemsize
    pages_per_seq = -(-max_len // page_size)
    pages = slots * pages_per_seq + 1
    pages += -pages % mesh.data  # the pool splits evenly over the replicas
    kv_shape = (cfg.num_layers, cfg.num_kv_heads, pages, page_size, cfg.head_dim)
    kv_bytes = 2 * rules.shard_bytes(kv_shape, KV_CACHE_AXES, sizes, kv_item, what="KV cache")
    if quantized:  # the scale pages, split as the values (kernels_pallas.kv_quant)
        kv_bytes += 2 * rules.shard_bytes(kv_shape[:-1], KV_CACHE_AXES[:-1], sizes, 4, what="KV scales")
    kv_local = rules.shard_shape(kv_shape, KV_CACHE_AXES, sizes)[1]
    heads_local = cfg.num_heads // (sizes["tensor"] if rules.mesh_axis("heads") == "tensor" else 1)
    vocab_local = cfg.vocab_size // (sizes["tensor"] if rules.mesh_axis("vocab") == "tensor" else 1)
    slots_local = slots // mesh.data
    ctx = pages_per_seq * page_size
    # Transients of the XLA reference path, float32 unless stored otherwise.
    decode_gather = 2 * slots_local * kv_local * ctx * cfg.head_dim * (2 if quantized else kv_item)  # dequantized: bf16
    prefill_scores = 2 * prefill_chunk * heads_local * ctx * 4  # scores and probabilities
    logits = max(slots_local, 1) * vocab_local * 4 * 2
    mlp_local = max(cfg.mlp_dim, cfg.expert_mlp_dim * cfg.num_experts_per_tok)
    mlp_local //= sizes["tensor"] if rules.mesh_axis("mlp") == "tensor" else 1
    hidden = prefill_chunk * (4 * cfg.hidden_size + 3 * mlp_local) * 4
    activations = max(decode_gather, prefill_scores) + logits + hidden
    # Decode reads: every weight on the device, except experts no row can reach.
    read = p_bytes
    if cfg.is_moe:
        expert_bytes = sum(b for n, b in per_param.items() if n in ("w_gate", "w_up", "w_down"))
        local_experts = cfg.num_experts // (sizes["expert"] if rules.mesh_axis("expert") == "expert" else 1)
        reachable = min(local_experts, slots * cfg.num_experts_per_tok)
        read -= expert_bytes - expert_bytes * reachable // local_experts
    read += kv_bytes * (slots * pages_per_seq) // pages  # the live pages, not the null page
    return ShardPlan(cfg.name, mesh, device, slots, max_len, p_bytes, p_total, kv_bytes, pages,
                     activations, read)


def load_model_config(model: str) -> ModelConfig:
    """A model config from a YAML path, a ``configs/*.yaml`` name (e.g. "llama3-70b"),
    a ``configs/models.yaml`` entry (e.g. "tiny-moe", or "gemma-3-270m" from its
    GGUF's metadata), or a GGUF path.

    Raises:
      ValueError: unknown name or not a model config.
    """
    from pathlib import Path

    import yaml

    path = Path(model)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return ModelConfig.from_dict(yaml.safe_load(path.read_text()))
    try:
        return ModelConfig.from_dict(_config_file(f"{model}.yaml"))
    except FileNotFoundError:
        pass
    models = _config_file("models.yaml")  # the registry's file (serving reads it too)
    if model in models and "config" in models[model]:
        return ModelConfig.from_dict(models[model]["config"])
    if model in models and models[model].get("source") == "gguf-package":
        import importlib

        from model.gguf_loader import read_gguf_config

        return read_gguf_config(importlib.import_module(models[model]["package"]).assemble(), name=model)
    if path.suffix == ".gguf" and path.is_file():
        from model.gguf_loader import read_gguf_config

        return read_gguf_config(path, name=path.stem)
    raise ValueError(f"unknown model config {model!r}: give a YAML or GGUF path, a name from configs/ "
                     f"(llama3-8b, llama3-70b, mixtral-8x7b, qwen3-30b-a3b) or a model from "
                     f"configs/models.yaml")


