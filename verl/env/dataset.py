"""An environment over prompt rows read from the user's JSONL/Parquet files.

Reading and normalising files is the data layer's job; this class takes rows already in the canonical
shape {"prompt": str | messages, "ground_truth": str | None, "data_source": str | None, "metadata": dict}
and adds the reward and the resumable order. Rows are checked up front (and PromptEnv checks that every
row's data_source has a reward function) so a bad file fails at start-up, not hours into a run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.data.index import is_lazy
from verl.env.base import PromptEnv
from verl.errors import DataError
from verl.rewards.manager import RewardManager


def _check_rows(rows: Sequence[Any], split: str) -> None:
    for i, row in enumerate(rows):
        where = f"{split} row {i}"
        if not isinstance(row, Mapping):
            raise DataError(
                f"{where} is a {type(row).__name__}, not a dict; rows must look like "
                "{'prompt': ..., 'ground_truth': ..., 'data_source': ..., 'metadata': {...}}."
            )
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DataError(f"{where} has an empty prompt; remove the row or fill in its prompt.")
        elif isinstance(prompt, list):
            bad = [
                j
                for j, m in enumerate(prompt)
                if not (isinstance(m, Mapping) and "role" in m and "content" in m)
            ]
            if not prompt or bad:
                raise DataError(
                    f"{where}: prompt is a message list but entries {bad or '(empty list)'} are "
                    "not {'role': ..., 'content': ...} dicts; fix the row's prompt."
                )
        else:
            raise DataError(
                f"{where}: prompt is {type(prompt).__name__}"
                f"{'' if 'prompt' in row else ' (missing)'}; it must be a string or a list of "
                "chat messages. Map your prompt column with data.fields."
            )
        ds = row.get("data_source")
        if ds is not None and not isinstance(ds, str):
            raise DataError(f"{where}: data_source must be a string or null, got {ds!r}.")
        meta = row.get("metadata")
        if meta is not None and not isinstance(meta, Mapping):
            raise DataError(f"{where}: metadata must be a dict or null, got {type(meta).__name__}.")


class DatasetEnv(PromptEnv):
    """Prompt rows from files + the configured reward functions."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        reward_manager: RewardManager,
        *,
        val_rows: Sequence[Mapping[str, Any]] = (),
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not rows:
            raise DataError(
                "the training data has no rows; check data.train_files (and data.on_bad_row: "
                "skip may have dropped every row)."
            )
        for split, checked in (("train", rows), ("val", val_rows)):
            if not is_lazy(checked):  # rows read on demand were checked by the data layer as they were indexed
                _check_rows(checked, split)
        super().__init__(rows, reward_manager, val_rows=val_rows, seed=seed, shuffle=shuffle)


__all__ = ["DatasetEnv"]
