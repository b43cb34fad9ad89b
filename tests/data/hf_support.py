"""Hugging Face `save_to_disk` folders written by hand with pyarrow, exactly as `datasets` writes them.

`Dataset.save_to_disk(path, num_shards=k)` writes `data-0000i-of-0000k.arrow` (Arrow IPC *stream* format,
the schema carrying a `huggingface` metadata key with the features), `state.json` (the shards in
`_data_files`, plus `_fingerprint`, `_format_*`, `_split`) and `dataset_info.json`; `DatasetDict` adds
`dataset_dict.json` (`{"splits": [...]}`) over one such folder per split. The tests need not install
`datasets`; where it is installed, `test_hf_folders.py` also checks these folders against the real one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa


def save_to_disk(folder: Path, rows: list[dict[str, Any]], num_shards: int = 1, split: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {"features": {}}})})
    table = table.replace_schema_metadata(schema.metadata)
    names = [f"data-{i:05d}-of-{num_shards:05d}.arrow" for i in range(num_shards)]
    per = -(-len(rows) // num_shards)
    for i, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            shard = table.slice(i * per, per)
            for batch in shard.to_batches(max_chunksize=3):  # several record batches per shard
                writer.write_batch(batch)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": split}
    (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return folder


def save_dict_to_disk(folder: Path, splits: dict[str, list[dict[str, Any]]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for name, rows in splits.items():
        save_to_disk(folder / name, rows, split=name)
    return folder


class FakeDataset:
    """What verl relies on of a `datasets.Dataset`: len, rows by index, column names, features, a format."""

    def __init__(self, rows: list[dict[str, Any]], fmt: str | None = None) -> None:
        self.rows, self.format = rows, {"type": fmt, "columns": None}
        self.column_names = sorted({k for r in rows for k in r})
        self.features = {k: "Value" for k in self.column_names}
        self.reads = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.reads += 1
        if self.format["type"] is not None:
            raise AssertionError("rows were read without with_format(None)")
        return dict(self.rows[i])

    def with_format(self, fmt: str | None) -> FakeDataset:
        return FakeDataset(self.rows, fmt)


class FakeIterableDataset:
    """A streaming `datasets.IterableDataset`: features and column names, iteration, no length."""

    features: dict[str, Any] = {}
    column_names = ["prompt"]

    def __iter__(self):
        yield {"prompt": "x"}





class FakeBatchedDataset(FakeDataset):
    """A `datasets.Dataset` read a batch of columns at a time (`Dataset.iter(batch_size)`), as the real one is."""

    def iter(self, batch_size: int):
        for start in range(0, len(self.rows), batch_size):
            chunk = self.rows[start : start + batch_size]
            yield {k: [r.get(k) for r in chunk] for k in self.column_names}
__all__ = ["FakeBatchedDataset", "FakeDataset", "FakeIterableDataset", "save_dict_to_disk", "save_to_disk"]
