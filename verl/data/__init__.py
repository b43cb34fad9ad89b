"""Data loading for verl: readers (files, Hugging Face folders and Dataset objects), field aliases, the data
report, the row index (rows read on demand), mixtures, datasets, collators and the sampler.

The torch-based datasets are imported lazily so that `verl data check|normalize` (which never needs
torch) stays fast to start and small in memory.
"""

from __future__ import annotations

from typing import Any

from verl.data.fields import KINDS, normalize_key
from verl.data.index import RowIndex
from verl.data.load import canonical_record, index_dataset, index_rows, iter_rows, load_rows, normalize_files
from verl.data.readers import expand_paths, iter_records
from verl.data.report import DataReport, TokenStats

_LAZY = {
    "PromptDataset": "verl.data.datasets",
    "SFTDataset": "verl.data.datasets",
    "PreferenceDataset": "verl.data.datasets",
    "RewardPairDataset": "verl.data.datasets",
    "IGNORE_INDEX": "verl.data.datasets",
    "ResumableOrder": "verl.data.sampler",
    "ResumableSampler": "verl.data.sampler",
    "MixtureOrder": "verl.data.sampler",
    "MixtureRows": "verl.data.mixture",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl.data' has no attribute {name!r}")


__all__ = [
    "KINDS",
    "DataReport",
    "TokenStats",
    "canonical_record",
    "expand_paths",
    "iter_records",
    "index_dataset",
    "index_rows",
    "iter_rows",
    "load_rows",
    "normalize_files",
    "normalize_key",
    "PromptDataset",
    "SFTDataset",
    "PreferenceDataset",
    "RewardPairDataset",
    "IGNORE_INDEX",
    "ResumableOrder",
    "ResumableSampler",
    "MixtureOrder",
    "MixtureRows",
    "RowIndex",
]
