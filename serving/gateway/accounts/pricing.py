"""Cost of a request from the price table in ``configs/prices.yaml``.

    cost = (((prompt - cached) * input + cached * cached_input + completion * output) / 1e6
            + images * per_image)
           * (1 - batch_discount if priority == "batch" else service_tiers[tier])

``service_tiers`` maps each service tier served ("default", "flex",
"priority") to a price multiplier (a tier not listed: 1). A Batch API line
(priority "batch", served at the flex tier) gets the batch discount instead of
the flex multiplier, not both.

Prices are USD per million tokens, per model, as OpenAI and most providers
publish them; ``per_image`` is USD per input image (its soft tokens are prompt tokens
too, priced as such; ``per_image`` adds to them, 0 by default). Reasoning tokens are billed as output (they are part of
``completion_tokens``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import yaml


@dataclasses.dataclass(frozen=True)
class ModelPrice:
    """USD per million tokens; ``per_image``: USD per input image."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0
    per_image: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"price {f.name} must be >= 0")


@dataclasses.dataclass(frozen=True)
class PriceTable:
    """Per-model prices, the batch-priority discount (a fraction in [0, 1]) and the
    service tiers' price multipliers (>= 0).

    ``parents`` maps a LoRA adapter's name to its base model's (filled by the gateway as
    adapters are served): an adapter the table does not name is charged its base model's
    price, then the default."""

    models: Mapping[str, ModelPrice]
    default: ModelPrice = ModelPrice()
    batch_discount: float = 0.0
    service_tiers: Mapping[str, float] = dataclasses.field(default_factory=dict)
    parents: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not 0.0 <= self.batch_discount <= 1.0:
            raise ValueError(f"batch_discount must be in [0, 1], got {self.batch_discount}")
        bad = {t: m for t, m in self.service_tiers.items()
               if t not in ("default", "flex", "priority") or not m >= 0}
        if bad:
            raise ValueError(f"service_tiers maps default, flex and priority to multipliers >= 0; got {bad}")

    def price(self, model: str) -> ModelPrice:
        """``model``'s price; for an adapter not named, its base model's; else the default."""
        if model in self.models:
            return self.models[model]
        return self.models.get(self.parents.get(model), self.default)

    def cost(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
             priority: str = "interactive", service_tier: str | None = None, images: int = 0) -> float:
        """USD for one request's token counts and input ``images``, served at `service_tier`
        (None: "default")."""
        p = self.price(model)
        usd = ((prompt_tokens - cached_tokens) * p.input + cached_tokens * p.cached_input
               + completion_tokens * p.output) / 1e6 + images * p.per_image
        if priority == "batch":
            usd *= 1.0 - self.batch_discount
        else:
            usd *= self.service_tiers.get(service_tier or "default", 1.0)
        return usd

    @classmethod
    def from_dict(cls, data: Mapping) -> "PriceTable":
        """Builds the table from the YAML layout (see configs/prices.yaml).

        Raises:
          ValueError: unknown keys or negative prices.
        """
        unknown = set(data) - {"models", "default", "batch_discount", "service_tiers"}
        if unknown:
            raise ValueError(f"unknown keys in the price table: {sorted(unknown)}")
        try:
            models = {name: ModelPrice(**p) for name, p in (data.get("models") or {}).items()}
            default = ModelPrice(**(data.get("default") or {}))
        except TypeError as e:
            raise ValueError(f"bad price entry: {e}") from None
        tiers = {str(t): float(m) for t, m in (data.get("service_tiers") or {}).items()}
        return cls(models=models, default=default, batch_discount=float(data.get("batch_discount", 0.0)),
                   service_tiers=tiers)


def load_price_table(path: str | Path | None = None) -> PriceTable:
    """The price table at `path`, or the shipped ``configs/prices.yaml``."""
    if path:
        data = yaml.safe_load(Path(path).read_text())
    else:
        from serving.config.config_files import read_config

        data = read_config("prices.yaml")
    return PriceTable.from_dict(data or {})
