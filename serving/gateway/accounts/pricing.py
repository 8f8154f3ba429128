"""Cost of a request from the price table in ``configs/prices.yaml``.

    cost = ((prompt - cached) * input + cached * cached_input + completion * output) / 1e6
           * (1 - batch_discount if priority == "batch" else 1)

Prices are USD per million tokens, per model, as OpenAI and most providers
publish them. Reasoning tokens are billed as output (they are part of
``completion_tokens``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import yaml


@dataclasses.dataclass(frozen=True)
class ModelPrice:
    """USD per million tokens."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"price {f.name} must be >= 0")


@dataclasses.dataclass(frozen=True)
class PriceTable:
    """Per-model prices and the batch-priority discount (a fraction in [0, 1])."""

    models: Mapping[str, ModelPrice]
    default: ModelPrice = ModelPrice()
    batch_discount: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.batch_discount <= 1.0:
            raise ValueError(f"batch_discount must be in [0, 1], got {self.batch_discount}")

    def price(self, model: str) -> ModelPrice:
        return self.models.get(model, self.default)

    def cost(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
             priority: str = "interactive") -> float:
        """USD for one request's token counts."""
        p = self.price(model)
        usd = ((prompt_tokens - cached_tokens) * p.input + cached_tokens * p.cached_input
               + completion_tokens * p.output) / 1e6
        if priority == "batch":
            usd *= 1.0 - self.batch_discount
        return usd

    @classmethod
    def from_dict(cls, data: Mapping) -> "PriceTable":
        """Builds the table from the YAML layout (see configs/prices.yaml).

        Raises:
          ValueError: unknown keys or negative prices.
        """
        unknown = set(data) - {"models", "default", "batch_discount"}
        if unknown:
            raise ValueError(f"unknown keys in the price table: {sorted(unknown)}")
        try:
            models = {name: ModelPrice(**p) for name, p in (data.get("models") or {}).items()}
            default = ModelPrice(**(data.get("default") or {}))
        except TypeError as e:
            raise ValueError(f"bad price entry: {e}") from None
        return cls(models=models, default=default, batch_discount=float(data.get("batch_discount", 0.0)))


def load_price_table(path: str | Path | None = None) -> PriceTable:
    """The price table at `path`, or the shipped ``configs/prices.yaml``."""
    if path:
        data = yaml.safe_load(Path(path).read_text())
    else:
        from serving.config.config_files import read_config

        data = read_config("prices.yaml")
    return PriceTable.from_dict(data or {})
