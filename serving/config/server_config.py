"""Server settings: ``configs/server.yaml`` overlaid with command-line overrides.

Also the data directory (``XLASERVE_DATA_DIR``, default: the user's data dir)
under which caches (dequantized weights, tokenizer, compiled programs) live.
No JAX here: the gateway reads its settings and data directory from this module.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from serving.config.config_files import read_config
from serving.config.engine_config import KV_CACHE_DTYPES
from serving.config.speculative_config import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """See configs/server.yaml for each field's meaning and unit."""

    model: str = "gemma-3-270m"
    revision: str | None = None
    task: str = "auto"
    embed_max_batch: int = 32
    embed_max_batch_tokens: int = 16384
    rerank_template: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int | None = None
    max_model_len: int = 8192
    max_slots: int = 32
    page_size: int = 16
    num_pages: int = 4096
    prefill_chunk: int = 512
    max_prefill_seqs: int = 32
    min_decode_batch: int | None = None
    max_waiting: int = 256
    max_waiting_tokens: int | None = None
    token_budget: int | None = None
    enable_prefix_caching: bool = True
    host_kv_cache_gib: float = 0.0
    kv_disk_dir: str | None = None
    kv_disk_max_bytes: int = 0
    attention_impl: str = "auto"
    drain_timeout: float = 30.0
    limit_concurrency: int | None = 2048
    header_timeout: float = 10.0
    max_request_bytes: int = 4 * 1024 * 1024
    max_file_bytes: int = 100 * 1024 * 1024
    batch_concurrency: int = 8
    batch_lease_seconds: float = 30.0
    flex_max_waiting: int = 0
    flex_max_kv_usage: float = 0.9
    flex_starvation_preemptions: int = 3
    flex_starvation_seconds: float = 60.0
    max_prompt_chars: int = 1_000_000
    default_chat_max_tokens: int | None = None
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    stream_buffer_events: int = 1024
    stream_write_timeout: float = 30.0
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images_per_request: int = 8
    max_tenant_image_pixels: int | None = None  # None: 4 x max_image_pixels
    tenant_image_pixel_rate: float = 20_000_000  # 0: no bound
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float = 10.0
    served_model_name: str | None = None
    database_url: str | None = None
    ledger_spool_dir: str | None = None
    ledger_spool_max_bytes: int = 256 * 1024 * 1024
    redis_url: str | None = None
    prices: str | None = None
    allow_unauthenticated: bool = False
    lora_root: str | None = None
    policy_blocklist: tuple[str, ...] = ()
    policy_blocklist_applies_to: tuple[str, ...] = ("input", "output")
    policy_plugins: tuple[str, ...] = ()
    prefix_cache_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    otel_traces: bool = False
    log_text: bool = False
    mesh: str | None = None
    checkpoint: str | None = None
    chat_template: str | None = None
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    quantization: str | None = None  # None: the backend policy's default (BackendPolicy.default_quantization)
    cpu_kernels: str = "auto"
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    speculative_max_batch: int | None = None
    speculative_token_budget: int | None = None
    draft_model: str | None = None
    draft_vocab: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int | None = None
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "lora_modules", _lora_modules(self.lora_modules))
        if (self.max_loras or 0) < 0 or self.max_lora_rank < 1 or (self.max_cpu_loras or 1) < 1:
            raise ValueError(f"max_loras must be >= 0, max_lora_rank and max_cpu_loras >= 1; got "
                             f"{self.max_loras}, {self.max_lora_rank}, {self.max_cpu_loras}")
        if self.lora_modules and self.max_loras == 0:
            raise ValueError("lora_modules need max_loras >= 1 (adapters resident on the device at once)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.quantization not in (None, "none", "int8", "auto"):  # model.quantization.QUANTIZATIONS + auto
            raise ValueError(f"quantization must be none, int8 or auto, got {self.quantization!r}")
        if self.cpu_kernels not in ("auto", "on", "off"):  # serving.engine.backend_policy.CPU_KERNELS
            raise ValueError(f"cpu_kernels must be auto, on or off, got {self.cpu_kernels!r}")
        if not self.host_kv_cache_gib >= 0:
            raise ValueError(f"host_kv_cache_gib must be >= 0, got {self.host_kv_cache_gib!r}")
        if self.host_kv_cache_gib and not self.enable_prefix_caching:
            raise ValueError("host_kv_cache_gib needs the prefix cache (host pages are found by prefix hash): "
                             "turn prefix caching on or the host tier off")
        if self.kv_disk_dir and (not self.host_kv_cache_gib or self.kv_disk_max_bytes <= 0):
            raise ValueError("kv_disk_dir needs host_kv_cache_gib > 0 (the disk tier sits under the host tier) "
                             f"and kv_disk_max_bytes > 0, got {self.host_kv_cache_gib!r} and "
                             f"{self.kv_disk_max_bytes!r}")
        if self.kv_disk_max_bytes and not self.kv_disk_dir:
            raise ValueError("kv_disk_max_bytes needs kv_disk_dir (where the disk KV tier keeps its files)")
        if self.task not in ("auto", "generate", "embed", "rerank"):  # serving.loading.model_source.TASKS
            raise ValueError(f"task must be auto, generate, embed or rerank, got {self.task!r}")
        if self.embed_max_batch < 1 or self.embed_max_batch & (self.embed_max_batch - 1):
            raise ValueError(f"embed_max_batch must be a power of two, got {self.embed_max_batch}")
        if self.kv_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"kv_dtype must be null, float32 or bfloat16, got {self.kv_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be a positive number of bytes, got {self.kv_cache_bytes!r}")
        for name, least in (("max_request_bytes", 1), ("max_prompt_chars", 1), ("stream_buffer_events", 2),
                            ("default_chat_max_tokens", 1), ("max_file_bytes", 1), ("batch_concurrency", 1),
                            ("ledger_spool_max_bytes", 1), ("max_image_bytes", 1), ("max_image_pixels", 1),
                            ("max_images_per_request", 1), ("max_tenant_image_pixels", 1), ("limit_concurrency", 1)):
            if getattr(self, name) is not None and getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)!r}")
        if self.tenant_image_pixel_rate < 0:
            raise ValueError(f"tenant_image_pixel_rate must be >= 0 pixels a second, got {self.tenant_image_pixel_rate!r}")
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout must be > 0 seconds, got {self.header_timeout!r}")
        if self.flex_max_waiting < 0 or self.flex_starvation_preemptions < 0:
            raise ValueError("flex_max_waiting and flex_starvation_preemptions must be >= 0")
        if not 0 <= self.flex_max_kv_usage <= 1 or not self.flex_starvation_seconds > 0:
            raise ValueError(f"flex_max_kv_usage must be in [0, 1] (got {self.flex_max_kv_usage!r}) and "
                             f"flex_starvation_seconds positive (got {self.flex_starvation_seconds!r})")
        if not self.batch_lease_seconds > 0:
            raise ValueError(f"batch_lease_seconds must be positive, got {self.batch_lease_seconds!r}")
        if not self.stream_write_timeout > 0:
            raise ValueError(f"stream_write_timeout must be positive, got {self.stream_write_timeout!r}")
        for name in ("policy_blocklist", "policy_blocklist_applies_to", "policy_plugins", "allowed_media_domains"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "prefix_cache_groups", _groups(self.prefix_cache_groups))
        SpeculativeConfig.from_settings(self.speculative, self.num_speculative_tokens,  # raises if invalid
                                        self.prompt_lookup_min, self.prompt_lookup_max,
                                        self.speculative_max_batch, self.draft_model,
                                        self.speculative_token_budget, self.draft_vocab)

    @property
    def lora_slots(self) -> int:
        """Adapters resident on the device at once: ``max_loras``, or when unset as many as
        ``lora_modules`` names, at most 4 (0: no LoRA)."""
        return min(len(self.lora_modules), 4) if self.max_loras is None else self.max_loras

    def with_overrides(self, overrides: Mapping[str, Any]) -> "ServerConfig":
        """Returns a copy with the non-None overrides applied. Raises ValueError on unknown keys."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown server settings {sorted(unknown)}; known: {sorted(known)}")
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """``lora_modules`` ({name: folder}, ["NAME=PATH", ...] or pairs) as (name, folder) pairs.

    Raises:
      ValueError: an entry without a name and a path, or a name given twice.
    """
    if isinstance(value, Mapping):
        value = list(value.items())
    if isinstance(value, str):
        value = [value]
    pairs = []
    for item in value or ():
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            item = (name.strip(), path.strip()) if sep else ("", "")
        if len(item) != 2 or not all(isinstance(v, str) and v for v in item):
            raise ValueError(f"lora_modules entries are NAME=PATH, got {item!r}")
        pairs.append(tuple(item))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules names a LoRA adapter twice: {names}")
    return tuple(pairs)


def _groups(value: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``prefix_cache_groups`` ({group: [tenant, ...]}, or its pairs) as sorted hashable pairs.

    Raises:
      ValueError: not a mapping of names to lists of names.
    """
    items = value.items() if isinstance(value, Mapping) else value
    try:
        items = [(group, tenants) for group, tenants in (items or ())]
    except (TypeError, ValueError):
        raise ValueError(f"prefix_cache_groups must map group names to lists of tenants, "
                         f"got {value!r}") from None
    pairs = []
    for group, tenants in items:
        if (not isinstance(group, str) or isinstance(tenants, str)
                or not isinstance(tenants, (list, tuple)) or not tenants
                or not all(isinstance(t, str) for t in tenants)):
            raise ValueError(f"prefix_cache_groups: group {group!r} must name a non-empty list "
                             f"of tenants, got {tenants!r}")
        pairs.append((group, tuple(tenants)))
    return tuple(sorted(pairs))


def load_server_config(path: str | os.PathLike | None = None, **overrides) -> ServerConfig:
    """Defaults from configs/server.yaml (or ``path``), then ``overrides``.

    Raises:
      ValueError: unknown keys or invalid values.
    """
    data = yaml.safe_load(Path(path).read_text()) if path else read_config("server.yaml")
    return ServerConfig().with_overrides(data or {}).with_overrides(overrides)


def data_dir() -> Path:
    """``$XLASERVE_DATA_DIR``, else the platform's user data directory for xlaserve."""
    env = os.environ.get("XLASERVE_DATA_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("xlaserve"))


def cache_dir(kind: str) -> Path:
    """A cache folder under the data dir: "weights", "tokenizer" or "jax"."""
    d = data_dir() / "cache" / kind
    d.mkdir(parents=True, exist_ok=True)
    return d
