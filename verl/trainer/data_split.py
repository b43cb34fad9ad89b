"""Training and validation rows from `data.*`: one reader and one hold-out rule for RL, SFT and DPO.

The rows are read with the tokenizer, prompt length limit and truncation policy the trainer uses, so a
prompt that is too long is found when the files are read (by `verl check` too), not mid-run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from verl.config.schema import RunConfig
from verl.data import DataReport, load_rows
from verl.errors import ConfigError, DataError, VerlError

# The row kind each trainer reads (`trainer.kind` -> data kind).
DATA_KINDS = {"rl": "prompt", "sft": "sft", "dpo": "preference", "rm": "preference"}


def read_rows(config: RunConfig, files: Sequence[str], kind: str, tokenizer: Any = None) -> tuple[list[dict[str, Any]], DataReport]:
    """Canonical rows of `files` and their report, length-checked when a tokenizer is given."""
    d = config.data
    return load_rows([config.resolve_path(f) for f in files], kind, fields=d.fields or None, on_bad_row=d.on_bad_row,
                     tokenizer=tokenizer, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                     apply_chat_template=d.apply_chat_template)


def hold_out(rows: list[dict[str, Any]], val_size: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, val): `val_size` rows picked by a seeded permutation become the validation set."""
    if val_size >= len(rows):
        raise DataError(f"data.val_size={val_size} leaves no training rows out of {len(rows)}")
    order = np.random.default_rng(seed).permutation(len(rows))
    held = set(order[:val_size].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


@dataclass
class DataSplit:
    """The rows a trainer trains and validates on, the reports of the files read, and what went wrong
    (each problem is kept, not raised, so one pass lists every one)."""

    train: list[dict[str, Any]] | None = None
    val: list[dict[str, Any]] = field(default_factory=list)
    reports: dict[str, DataReport] = field(default_factory=dict)
    problems: list[VerlError] = field(default_factory=list)

    def rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(train, val), raising the first problem."""
        if self.problems:
            raise self.problems[0]
        return self.train or [], self.val


def split_train_val(config: RunConfig, kind: str, tokenizer: Any = None,
                    train: list[dict[str, Any]] | None = None) -> DataSplit:
    """Train rows (`train`, rows given in Python, or data.train_files), then validation rows from
    data.val_files, else `data.val_size` rows held out of train, else none."""
    d = config.data
    out = DataSplit(train=train)

    def read(name: str, files: Sequence[str]) -> list[dict[str, Any]] | None:
        try:
            rows, out.reports[name] = read_rows(config, files, kind, tokenizer)
            return rows
        except VerlError as exc:
            out.problems.append(type(exc)(f"{name} data: {exc}"))
            return None

    if train is None:
        if d.train_files:
            out.train = read("train", d.train_files)
        else:
            out.problems.append(ConfigError(
                "no training data: set data.train_files (JSONL/JSON/Parquet/CSV) or use a built-in "
                "environment with env.name=arithmetic"))
    if d.val_files:
        out.val = read("val", d.val_files) or []
    elif d.val_size and out.train is not None:
        try:
            out.train, out.val = hold_out(out.train, d.val_size, config.trainer.seed)
        except VerlError as exc:
            out.problems.append(exc)
    return out


def canonical_rows(rows: Sequence[Mapping[str, Any]], config: RunConfig) -> list[dict[str, Any]]:
    """In-memory prompt rows through the same field aliases as files (`question`/`answer`, `data.fields`)."""
    from verl.data.fields import RowError, RowNormalizer

    if config.env.name is not None:
        raise ConfigError(f"prompt rows were passed in, but env.name={config.env.name!r} makes its own "
                          "prompts; drop the rows or set env.name to null (the rows + reward functions)")
    normalizer = RowNormalizer("prompt", config.data.fields or None)
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"dataset[{i}] is a {type(row).__name__}; each row must be a dict like "
                            "{'prompt': '...', 'ground_truth': '...'} (or pass file paths as strings)")
        try:
            out.append(normalizer.normalize(dict(row))[0])
        except RowError as exc:
            raise DataError(f"dataset[{i}]: {exc.detail}; fix the row or map its keys with "
                            "data.fields (e.g. data={'fields': {'prompt': 'my_column'}})") from None
    if not out:
        raise DataError("dataset=[] has no rows; pass at least one prompt row")
    return out


__all__ = ["canonical_rows", "DATA_KINDS", "DataSplit", "hold_out", "read_rows", "split_train_val"]
