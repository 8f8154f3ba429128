"""Reading the YAML data files shipped in ``configs/`` (the serving side's files).

``configs/`` holds data only. The serving side reads ``server.yaml``,
``models.yaml`` and ``prices.yaml`` through :func:`read_config`; ``sharding/``
reads its own files (``sharding.yaml``, ``devices.yaml`` and the model shapes
it plans for) itself. This module imports nothing of ours, so the gateway, the
engine side and the CLI can all use it.
"""

from __future__ import annotations

from importlib import resources

import yaml


def read_config(name: str) -> dict:
    """The parsed ``configs/NAME`` (shipped as package data); {} for an empty file.

    Raises:
      FileNotFoundError: no such file in ``configs/``.
      yaml.YAMLError: the file is not valid YAML.
    """
    return yaml.safe_load(resources.files("configs").joinpath(name).read_text()) or {}
