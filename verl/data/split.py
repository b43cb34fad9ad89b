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
from verl.data import DataReport
from verl.data.hf import is_hf, split_suffix
from verl.data.index import RowIndex, is_lazy
from verl.data.load import index_dataset, index_rows
from verl.data.mixture import MixtureRows
from verl.errors import ConfigError, DataError, VerlError
from verl.utils.tokenizer_protocol import Tokenizer

# The row kind each trainer reads (`trainer.kind` -> data kind).
DATA_KINDS = {"rl": "prompt", "sft": "sft", "dpo": "preference", "rm": "preference"}


def _resolve(config: RunConfig, path: str) -> str:
    """A data path by the relative-path rule; a DatasetDict split suffix (`folder:train`) stays on the folder."""
    base, split = split_suffix(path)
    return config.resolve_path(base) + (f":{split}" if split is not None else "")


def read_rows(config: RunConfig, files: Sequence[str], kind: str, tokenizer: Tokenizer | None = None,
              purpose: str = "train") -> tuple[RowIndex, DataReport]:
    """Canonical rows of `files` and their report, length-checked when a tokenizer is given. The rows stay
    in their files (`verl.data.index`): a multi-gigabyte dataset is checked as it streams and read back a
    batch at a time. `purpose` (train, val) picks a DatasetDict folder's split when none is named."""
    d = config.data
    return index_rows([_resolve(config, f) for f in files], kind, fields=d.fields or None, on_bad_row=d.on_bad_row,
                      tokenizer=tokenizer, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                      apply_chat_template=d.apply_chat_template, purpose=purpose)


def hold_out(rows: Sequence[dict[str, Any]], val_size: int,
             seed: int) -> tuple[Sequence[dict[str, Any]], Sequence[dict[str, Any]]]:
    """(train, val): `val_size` rows picked by a seeded permutation become the validation set (views of
    rows read on demand, lists of rows in memory)."""
    if val_size >= len(rows):
        raise DataError(f"data.val_size={val_size} leaves no training rows out of {len(rows)}")
    order = np.random.default_rng(seed).permutation(len(rows))
    held = np.zeros(len(rows), dtype=bool)
    held[order[:val_size]] = True
    if is_lazy(rows):
        return rows.subset(np.flatnonzero(~held)), rows.subset(np.flatnonzero(held))
    return [r for i, r in enumerate(rows) if not held[i]], [r for i, r in enumerate(rows) if held[i]]


@dataclass
class DataSplit:
    """The rows a trainer trains and validates on, the reports of the files read, and what went wrong
    (each problem is kept, not raised, so one pass lists every one)."""

    train: Sequence[dict[str, Any]] | None = None
    val: Sequence[dict[str, Any]] = field(default_factory=list)
    reports: dict[str, DataReport] = field(default_factory=dict)
    problems: list[VerlError] = field(default_factory=list)

    def rows(self) -> tuple[Sequence[dict[str, Any]], Sequence[dict[str, Any]]]:
        """(train, val), raising the first problem."""
        if self.problems:
            raise self.problems[0]
        return self.train or [], self.val


def split_train_val(config: RunConfig, kind: str, tokenizer: Tokenizer | None = None,
                    train: Sequence[dict[str, Any]] | None = None) -> DataSplit:
    """Train rows (`train`, rows given in Python, data.train_files or data.mixture), then validation rows
    from data.val_files, else `data.val_size` rows held out of train, else none."""
    d = config.data
    out = DataSplit(train=train)

    def read(name: str, files: Sequence[str], purpose: str) -> RowIndex | None:
        try:
            rows, out.reports[name] = read_rows(config, files, kind, tokenizer, purpose)
            return rows
        except VerlError as exc:
            out.problems.append(type(exc)(f"{name} data: {exc}"))
            return None

    if d.mixture and kind != "prompt":
        out.problems.append(ConfigError(
            f"data.mixture weights the prompts RL draws; the {kind} trainer reads every row each epoch, so the "
            f"weights would be ignored. Fix: list the files in data.train_files "
            f"({', '.join(f for m in d.mixture for f in m.files)})"))
        return out
    if train is None:
        if d.mixture:
            parts = [read(f"train (mixture {m.name})", m.files, "train") for m in d.mixture]
            if all(p is not None for p in parts):
                out.train = MixtureRows(parts, [m.name for m in d.mixture], [m.weight for m in d.mixture])
        elif d.train_files:
            out.train = read("train", d.train_files, "train")
        else:
            out.problems.append(ConfigError(
                "no training data: set data.train_files (JSONL/JSON/Parquet/CSV/Arrow files or a save_to_disk "
                "folder) or data.mixture, or use a built-in environment with env.name=arithmetic"))
    if d.val_files:
        out.val = read("val", d.val_files, "val") or []
    elif d.val_size and out.train is not None:
        try:
            out.train, out.val = hold_out(out.train, d.val_size, config.trainer.seed)
        except VerlError as exc:
            out.problems.append(exc)
    return out


def python_rows(dataset: Any, config: RunConfig, kind: str, name: str, purpose: str = "train",
                tokenizer: Tokenizer | None = None) -> RowIndex:
    """A `datasets.Dataset` / `DatasetDict` passed in from Python through the same checks and report as
    files (a bad row is named `name[i]`; data.on_bad_row and data.truncation apply); rows are read from the
    object on demand."""
    d = config.data
    rows, _ = index_dataset(dataset, kind, name=name, purpose=purpose, fields=d.fields or None,
                            on_bad_row=d.on_bad_row, tokenizer=tokenizer, max_prompt_length=d.max_prompt_length,
                            truncation=d.truncation, apply_chat_template=d.apply_chat_template)
    return rows


def canonical_rows(rows: Any, config: RunConfig, tokenizer: Tokenizer | None = None) -> Sequence[dict[str, Any]]:
    """Prompt rows passed in from Python through the same field aliases as files (`question`/`answer`,
    `data.fields`): a list of dicts, or a `datasets.Dataset` / `DatasetDict` (its train split)."""
    from verl.data.fields import RowError, RowNormalizer

    if config.env.name is not None:
        raise ConfigError(f"prompt rows were passed in, but env.name={config.env.name!r} makes its own "
                          "prompts; drop the rows or set env.name to null (the rows + reward functions)")
    if is_hf(rows):
        return python_rows(rows, config, "prompt", "dataset", tokenizer=tokenizer)
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


__all__ = ["canonical_rows", "DATA_KINDS", "DataSplit", "hold_out", "python_rows", "read_rows", "split_train_val"]
