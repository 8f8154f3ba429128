"""What a ``--model`` value names: the one place the four forms are told apart.

    registry name    gemma-3-270m, tiny-random, ...   (configs/models.yaml)
    GGUF file        path/to/model.gguf
    HF directory     path/to/dir  (config.json + model.safetensors or model.safetensors.index.json)
    Hub id           org/name     (resolved by huggingface_hub into its cache)

:func:`resolve_model` returns a :class:`ModelSource`; ``serving.loading.model_registry``
loads it, ``serving.cli.convert`` converts it, ``serving.cli.shard_plan`` plans it. An existing path wins
over a hub id of the same spelling. A hub id is fetched with
``huggingface_hub.snapshot_download`` (only the files a model needs,
:data:`SERVE_FILES`): from its cache (``HF_HOME`` / ``HF_HUB_CACHE``) when
``HF_HUB_OFFLINE=1`` or the Hub cannot be reached, downloaded otherwise;
``HF_TOKEN`` (or a ``huggingface-cli login`` token) is read by the library for
gated and private repositories.

No JAX here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

__all__ = ["ModelSource", "resolve_model", "resolve_task", "is_hub_id", "stored_quantized", "SERVE_FILES",
           "CONFIG_FILES", "ACCEPTED_FORMS", "TASKS"]

TASKS = ("auto", "generate", "embed", "rerank")
"""``serve --task`` values (see :func:`resolve_task`)."""

SERVE_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
               "chat_template.jinja", "modules.json", "config_sentence_transformers.json",
               "sentence_bert_config.json", "[0-9]*_Pooling/*", "[0-9]*_Dense/*", "[0-9]*_Normalize/*")
"""``allow_patterns`` for serving a hub id: config, weights (not a repository's
``consolidated.safetensors`` or ``original/`` copies), tokenizer and chat template, and a
sentence-transformers model's modules (``model.sentence_transformers``)."""

CONFIG_FILES = ("config.json",)
"""``allow_patterns`` for planning a hub id (``xlaserve shard-plan``)."""

ACCEPTED_FORMS = ("a model name from configs/models.yaml ({names}), a path to a .gguf file, "
                  "a Hugging Face checkpoint directory (config.json with model.safetensors or "
                  "model.safetensors.index.json), or a Hugging Face Hub id (org/name)")

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model`` value.

    Attributes:
      kind: "registry", "gguf", "hf" (a local Hugging Face directory) or "hub"
        (a hub id, now a directory in huggingface_hub's cache).
      value: the ``--model`` value as given.
      name: the served model name: the registry name, the GGUF's stem, the
        directory's name, or the hub id.
      path: the GGUF file or the checkpoint directory (for "hub": the cached
        snapshot); None for "registry".
    """

    kind: str
    value: str
    name: str
    path: Path | None = None

    @property
    def is_hf(self) -> bool:
        """A Hugging Face checkpoint directory (local, or a hub id's snapshot)."""
        return self.kind in ("hf", "hub")


def is_hub_id(value: str) -> bool:
    """Whether ``value`` is spelled as a Hub repository id ``org/name``."""
    return bool(_HUB_ID.fullmatch(value)) and ".." not in value


def _registry() -> dict:
    from serving.config.config_files import read_config

    return read_config("models.yaml")


def _is_orbax_checkpoint(p: Path) -> bool:
    return (p / "config.json").is_file() and (p / "params").is_dir()


def resolve_model(value: str, revision: str | None = None, files: tuple[str, ...] = SERVE_FILES,
                  registry: dict | None = None) -> ModelSource:
    """Tells which of the four forms ``value`` is; a hub id is fetched (or found in the cache).

    Args:
      value: the ``--model`` value.
      revision: for a hub id, the branch, tag or commit (None: ``main``); any
        other form with a revision is an error.
      files: for a hub id, the ``allow_patterns`` to fetch (:data:`SERVE_FILES`,
        or :data:`CONFIG_FILES` for planning).
      registry: configs/models.yaml's entries (default: read it).

    Returns:
      A :class:`ModelSource`.

    Raises:
      ValueError: none of the forms (the message lists them), a directory that is
        not a Hugging Face checkpoint (naming what it lacks; an orbax checkpoint is
        pointed to ``--checkpoint``), a revision for a local model, or a hub id
        that cannot be fetched (the library's reason: offline without a cached
        snapshot, an unknown or gated repository, ...).
    """
    registry = _registry() if registry is None else registry
    path = Path(value).expanduser()
    if revision is not None and (value in registry or path.exists() or not is_hub_id(value)):
        raise ValueError(f"--revision {revision!r} applies to a Hugging Face Hub id, not to {value!r}")
    if value in registry:
        return ModelSource("registry", value, value)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", value, path.stem, path)
    if path.is_dir():
        return ModelSource("hf", value, path.resolve().name, _check_hf_dir(path, files=files))
    if path.suffix == ".gguf" or path.exists():
        raise ValueError(f"--model {value!r}: no such .gguf file" if not path.exists() else
                         f"--model {value!r} is a file but not a .gguf; use " + _forms(registry))
    if is_hub_id(value):
        return ModelSource("hub", value, value, _check_hf_dir(_snapshot(value, revision, files), hub=True,
                                                              files=files))
    raise ValueError(f"unknown model {value!r}: use {_forms(registry)}")


def stored_quantized(value: str, registry: dict | None = None) -> bool:
    """Whether ``--model value`` stores its weight matrices quantized (in ggml blocks): a
    registry entry assembled from a GGUF package (``source: gguf-package``, as the default
    gemma-3-270m Q4_K_M), or a .gguf file with any tensor of a block type (Q8_0, Q4_K, ...:
    not F32 / F16 / BF16 / F64 or an integer type; its header only is read). False for
    everything else (random registry models, Hugging Face checkpoints, hub ids: nothing is
    fetched), for a mixture-of-experts GGUF (``{arch}.expert_count`` above 0: int8 weights are
    refused for those, so the default must not pick them), and for a file whose header does not
    read (the loader reports that).
    The backend policy's default ``--quantization`` asks this
    (``serving.engine.backend_policy.BackendPolicy.default_quantization``)."""
    registry = _registry() if registry is None else registry
    if value in registry:
        return (registry[value] or {}).get("source") == "gguf-package"
    path = Path(value).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        return False
    from gguf import GGMLQuantizationType as T

    from model.gguf_metadata import read_gguf_header

    plain = {int(t) for t in (T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64)}
    try:
        header = read_gguf_header(path)
    except (OSError, ValueError):
        return False
    arch = header.metadata.get("general.architecture")
    if (header.metadata.get(f"{arch}.expert_count") or 0) > 0:
        return False
    return any(kind not in plain for _, kind in header.tensors.values())


def resolve_task(task: str, model: str, revision: str | None = None) -> str:
    """"generate", "embed" or "rerank" for ``--task`` (``auto``: "rerank" when ``model``'s
    ``config.json`` names a sequence-classification architecture (a cross-encoder); else "embed" when it is a sentence-transformers directory, local
    or a Hub snapshot, i.e. one with ``modules.json``; else "generate").

    Raises:
      ValueError: an unknown task.
    """
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if task != "auto":
        return task
    path = Path(model).expanduser()
    if path.is_dir():
        return _task_of(path)
    if path.exists() or path.suffix == ".gguf" or not is_hub_id(model) or model in _registry():
        return "generate"
    try:
        source = resolve_model(model, revision=revision)
    except ValueError:
        return "generate"  # the generation path reports what is wrong with the value
    return _task_of(source.path) if source.path is not None else "generate"


def _task_of(path: Path) -> str:
    """A sequence-classification checkpoint (its config.json's ``architectures``) reranks (the
    loader names the architectures it reads); a sentence-transformers directory embeds."""
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        archs = []
    if any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs):
        return "rerank"
    return "embed" if (path / "modules.json").is_file() else "generate"


def _forms(registry: dict) -> str:
    return ACCEPTED_FORMS.format(names=", ".join(sorted(registry)))


def _check_hf_dir(path: Path, hub: bool = False, files: tuple[str, ...] = SERVE_FILES) -> Path:
    """``path`` if it holds what ``files`` asks for of a Hugging Face checkpoint, else a ValueError
    naming what is missing."""
    where = "the Hub snapshot " + str(path) if hub else str(path)
    if not hub and _is_orbax_checkpoint(path):
        raise ValueError(f"{path} is an xlaserve (orbax) checkpoint: serve it with --checkpoint {path}")
    if (path / "modules.json").is_file() and not (path / "config.json").is_file():
        return path  # a sentence-transformers directory with its transformer in a folder
    if not (path / "config.json").is_file():
        raise ValueError(f"{where} is not a Hugging Face checkpoint: it has no config.json")
    if files == CONFIG_FILES:
        return path
    if not ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()):
        raise ValueError(f"{where} is not a Hugging Face checkpoint xlaserve reads: it has neither "
                         f"model.safetensors nor model.safetensors.index.json")
    return path


def _snapshot(repo_id: str, revision: str | None, files: tuple[str, ...]) -> Path:
    """The local snapshot directory of ``repo_id`` at ``revision`` (huggingface_hub's cache)."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=list(files))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise ValueError(f"cannot fetch the Hugging Face Hub model {repo_id!r}"
                         f"{'' if revision is None else f' at revision {revision!r}'}: {e}") from None
    return Path(folder)
