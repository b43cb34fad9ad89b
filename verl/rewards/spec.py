"""The config shape of one reward function (`reward.functions[i]`).

It lives here, not in verl.config, so the rewards layer owns what it accepts and the config schema can embed
it without the rewards layer importing the config layer.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RewardFunctionSpec(BaseModel):
    """One reward function and where it applies.

    `name` is a built-in (`exact_match`, `numeric_match`, `format`, `remote`), a file (`path/to/file.py:fn`, relative to
    the config file's directory) or an importable module (`package.module:fn`). `weight` 0 keeps a function
    for its metrics only; a negative weight makes it a penalty. `data_sources=None` applies the function to
    every sample; a list restricts it to samples whose `data_source` is in the list. `batched=True` calls the
    function once per batch with lists instead of once per sample.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)
    data_sources: list[str] | None = None
    batched: bool = False

    @field_validator("name")
    @classmethod
    def _name_not_blank(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError(
                "name is blank; use a built-in (exact_match, numeric_match, format, remote), "
                "'path/to/file.py:fn' or 'package.module:fn'"
            )
        return v

    @field_validator("weight")
    @classmethod
    def _weight_finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"weight must be a finite number, got {v}")
        return v

    @field_validator("data_sources")
    @classmethod
    def _sources_usable(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError(
                "data_sources is an empty list, so the function would apply to no sample; "
                "remove the key (= every sample) or list the data_source values it scores"
            )
        blank = [i for i, s in enumerate(v) if not s.strip()]
        if blank:
            raise ValueError(f"data_sources has blank entries at positions {blank}; remove them")
        return v


__all__ = ["RewardFunctionSpec"]
