"""The base every config section shares (unknown keys and inf/nan refused) and the helpers their validators use."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict

# Threads (or worker processes) one setting may start: far above any host's cores, below what exhausts a host's
# thread limit and memory for stacks (100000 reward workers started 6,000 threads in a second before failing).
MAX_THREADS = 1024
MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy take a seed of at most 64 bits


class Section(BaseModel):
    # allow_inf_nan=False: no float setting survives inf or nan (a learning rate of inf reaches the sampler as nan)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)


def _home(value: Any) -> Any:
    """`~/models/x` as the shell would expand it (volcengine/verl's own defaults are written that way)."""
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return [_home(v) for v in value]
    return value


def _split_csv(value: Any) -> Any:
    """Accept `0,1` / `"a.jsonl,b.jsonl"` (CLI style) as well as real lists; a scalar becomes a list of one."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().strip("[]").split(",")]
        return [p for p in parts if p]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return value
