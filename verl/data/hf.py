"""Hugging Face `datasets` without the `datasets` library: `save_to_disk` folders and Dataset objects.

A `Dataset.save_to_disk` folder holds `state.json` (which names the shards in `_data_files`),
`dataset_info.json` (the features) and `data-NNNNN-of-NNNNN.arrow` shards in the Arrow IPC stream format;
a `DatasetDict` folder holds `dataset_dict.json` (`{"splits": [...]}`) and one such folder per split.
pyarrow reads the shards (memory-mapped when rows are fetched), so users need not install `datasets`,
and a folder is found to be broken (a missing shard, a split that does not exist) before training.

In Python, a `datasets.Dataset` / `DatasetDict` is recognised by its attributes (duck typing), so that
importing verl never imports `datasets`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl.errors import DataError

STATE = "state.json"
INFO = "dataset_info.json"
DICT = "dataset_dict.json"
# The split a DatasetDict gives when none is named, by what the rows are for (the first name present wins).
SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "val": ("validation", "valid", "val", "test", "eval"),
}
_SPLIT_SUFFIX = re.compile(r"^(?P<base>.+):(?P<split>[A-Za-z0-9_.\-]+)$")
LAYOUT_HELP = ("a Hugging Face save_to_disk folder is either a Dataset (state.json, dataset_info.json and the "
               "data-*.arrow shards that state.json lists) or a DatasetDict (dataset_dict.json and one such "
               "folder per split)")


def split_suffix(path: str) -> tuple[str, str | None]:
    """`folder:train` -> (`folder`, `train`): the split of a DatasetDict folder, when `path` itself does not
    exist (so a file whose name holds a colon is still read as it is)."""
    m = _SPLIT_SUFFIX.match(str(path))
    if m is None or Path(path).exists() or "/" in m["split"]:
        return str(path), None
    return m["base"], m["split"]


def layout(folder: Path) -> str | None:
    """'dataset', 'dict' or None (not a save_to_disk folder)."""
    if (folder / STATE).is_file():
        return "dataset"
    if (folder / DICT).is_file():
        return "dict"
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot be read as JSON ({e}); re-save the dataset with save_to_disk") from None


def dataset_files(folder: Path) -> list[str]:
    """The arrow shards a Dataset folder's state.json lists, in order, each checked to exist."""
    state = _read_json(folder / STATE)
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries or not all(
            isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries):
        raise DataError(f"{folder / STATE}: expected '_data_files': [{{\"filename\": \"data-00000-of-00001.arrow\"}}, "
                        f"...] (what Dataset.save_to_disk writes), found {str(entries)[:80]}; {LAYOUT_HELP}")
    files = [folder / e["filename"] for e in entries]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(f"{folder}: state.json lists {', '.join(missing)}, which the folder does not hold "
                        f"(found: {found_listing(folder)}); the folder was copied incompletely: copy it again "
                        "or re-save it with save_to_disk")
    return [str(f) for f in files]


def splits_of(folder: Path) -> list[str]:
    data = _read_json(folder / DICT)
    splits = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise DataError(f"{folder / DICT}: expected {{\"splits\": [\"train\", ...]}}, found {str(data)[:80]}; "
                        f"{LAYOUT_HELP}")
    return splits


def pick_split(splits: Sequence[str], split: str | None, purpose: str, where: str) -> str:
    """The split named explicitly, else the one named for `purpose` (train, val), else the only one."""
    if split is not None:
        if split not in splits:
            raise DataError(f"{where} has no split {split!r}; its splits are {', '.join(splits) or '(none)'}. "
                            f"Name one of them, e.g. {where}:{splits[0] if splits else 'train'}")
        return split
    for name in SPLIT_NAMES.get(purpose, (purpose,)):
        if name in splits:
            return name
    if len(splits) == 1:
        return splits[0]
    raise DataError(f"{where} is a DatasetDict with splits {', '.join(splits) or '(none)'} and none is named "
                    f"{' or '.join(SPLIT_NAMES.get(purpose, (purpose,)))}; name the split to read, e.g. "
                    f"{where}:{splits[0] if splits else 'train'}")


def folder_files(folder: Path, split: str | None = None, purpose: str = "train") -> list[str]:
    """The arrow shards of a save_to_disk folder (a DatasetDict's split picked by `pick_split`)."""
    kind = layout(folder)
    if kind == "dataset":
        if split is not None:
            raise DataError(f"{folder}:{split}: {folder} is a single Dataset (state.json), which has no splits; "
                            f"drop ':{split}'")
        return dataset_files(folder)
    if kind != "dict":
        raise DataError(f"{folder}:{split}: {folder} is not a DatasetDict folder (no {DICT}); found: "
                        f"{found_listing(folder)}. {LAYOUT_HELP}")
    name = pick_split(splits_of(folder), split, purpose, str(folder))
    sub = folder / name
    if layout(sub) != "dataset":
        raise DataError(f"{folder}: dataset_dict.json lists split {name!r}, but {sub} is not a Dataset folder "
                        f"(no {STATE}; found: {found_listing(sub) if sub.is_dir() else 'nothing'}). {LAYOUT_HELP}")
    return dataset_files(sub)


def found_listing(folder: Path, limit: int = 8) -> str:
    """What a folder holds, for error messages: the first few names, folders marked with '/'."""
    try:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    except OSError:
        return "(unreadable)"
    if not entries:
        return "nothing (the folder is empty)"
    more = f" and {len(entries) - limit} more" if len(entries) > limit else ""
    return ", ".join(entries[:limit]) + more


# ---------------------------------------------------------------- datasets.Dataset objects (duck-typed)


def is_dataset(obj: Any) -> bool:
    """A `datasets.Dataset` (or anything shaped like one: rows by index, a length, named columns)."""
    return (not isinstance(obj, (str, bytes, Mapping, list, tuple)) and hasattr(obj, "column_names")
            and hasattr(obj, "features") and hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


def is_streaming_dataset(obj: Any) -> bool:
    """A `datasets.IterableDataset` (load_dataset(..., streaming=True)): no length, no rows by index."""
    return (not isinstance(obj, (str, bytes, Mapping, list, tuple)) and hasattr(obj, "features")
            and hasattr(obj, "__iter__") and not hasattr(obj, "__len__") and hasattr(obj, "column_names"))


def is_dataset_dict(obj: Any) -> bool:
    """A `datasets.DatasetDict`: a mapping of split name -> Dataset."""
    return isinstance(obj, Mapping) and bool(obj) and all(
        isinstance(k, str) and (is_dataset(v) or is_streaming_dataset(v)) for k, v in obj.items())


def is_hf(obj: Any) -> bool:
    return is_dataset(obj) or is_dataset_dict(obj) or is_streaming_dataset(obj)


def python_dataset(obj: Any, name: str, purpose: str = "train") -> tuple[Any, str]:
    """(the Dataset to read, the name rows are reported under): a DatasetDict gives the split named for
    `purpose` (or its only one); rows come back as Python objects whatever format was set on it."""
    if is_dataset_dict(obj):
        split = pick_split(list(obj), None, purpose, name)
        obj, name = obj[split], f"{name}[{split!r}]"
    if is_streaming_dataset(obj):
        raise DataError(f"{name} is a streaming IterableDataset, which has no length and no rows by index, so it "
                        "cannot be checked up front and shuffled per epoch. Load it without streaming=True, or "
                        "save it (ds.save_to_disk(PATH)) and set data.train_files: [PATH] (read memory-mapped)")
    if _decodes_images(getattr(obj, "features", None)) and hasattr(obj, "with_format"):
        return UndecodedRows(obj), name
    fmt = getattr(obj, "format", None)
    if isinstance(fmt, Mapping) and fmt.get("type") is not None and hasattr(obj, "with_format"):
        obj = obj.with_format(None)  # rows as Python objects, not tensors or arrays
    return obj, name


def _decodes_images(feature: Any, depth: int = 0) -> bool:
    """Whether `datasets` features decode an `Image` column to PIL on access (nested in lists and dicts too)."""
    if depth > 16 or feature is None or isinstance(feature, (str, bytes)):
        return False
    if type(feature).__name__ == "Image" and getattr(feature, "decode", False):
        return True
    if isinstance(feature, Mapping):
        return any(_decodes_images(f, depth + 1) for f in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_decodes_images(f, depth + 1) for f in feature)
    return _decodes_images(getattr(feature, "feature", None), depth + 1)


class UndecodedRows:
    """A `datasets.Dataset` with `Image` columns, read through its Arrow format: an image comes back as the
    `{"bytes": ..., "path": ...}` it is stored as, so checking rows opens only the headers (verl.data.images),
    a missing image file is a bad row rather than an exception from `datasets`, and no pixels are held."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset.with_format("arrow")
        self.column_names = list(dataset.column_names)
        self.features = dataset.features

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.dataset[int(i)].to_pylist()[0]

    def iter(self, batch_size: int) -> Any:
        for table in self.dataset.iter(batch_size=batch_size):
            yield table.to_pydict()


__all__ = ["UndecodedRows", "SPLIT_NAMES", "dataset_files", "folder_files", "found_listing", "is_dataset",
           "is_dataset_dict", "is_hf", "is_streaming_dataset", "layout", "pick_split", "python_dataset", "split_suffix"]
