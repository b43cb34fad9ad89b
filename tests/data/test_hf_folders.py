"""Hugging Face `save_to_disk` folders as data.train_files / val_files: the same checks and report as files,
DatasetDict splits picked by name, and folders of an unknown layout refused with what was found."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from hf_support import save_dict_to_disk, save_to_disk

from verl.config.loader import build_config
from verl.data import expand_paths, index_rows, load_rows
from verl.data.split import split_train_val
from verl.errors import DataError

ROWS = [{"question": f"what is {i}+1?", "answer": i + 1, "data_source": "arith"} for i in range(7)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_dataset_folder_reads_like_the_same_rows_in_jsonl(tmp_path: Path) -> None:
    folder = save_to_disk(tmp_path / "ds", ROWS, num_shards=3)
    files, ignored = expand_paths(folder)
    assert [Path(f).name for f in files] == [f"data-{i:05d}-of-00003.arrow" for i in range(3)] and not ignored
    rows, report = load_rows(folder, "prompt")
    same, _ = load_rows(_jsonl(tmp_path / "same.jsonl", ROWS), "prompt")
    strip = [{k: v for k, v in r.items() if k not in ("file", "line")} for r in rows]
    assert strip == [{k: v for k, v in r.items() if k not in ("file", "line")} for r in same]
    assert report.field_mapping["prompt"] == {"question": 7} and report.is_clean
    index, _ = index_rows(folder, "prompt")  # what the trainers read: the same rows, read back on demand
    assert list(index) == rows and index[-1]["ground_truth"] == "7"


def test_a_bad_row_is_named_by_its_shard_and_row(tmp_path: Path) -> None:
    rows = [*ROWS[:4], {"question": None, "answer": 1}, *ROWS[4:]]
    folder = save_to_disk(tmp_path / "ds", rows, num_shards=2)  # 8 rows: 4 per shard, the bad one is row 1 of 2
    with pytest.raises(DataError) as err:
        index_rows(folder, "prompt")
    assert "1 of 8 rows are bad" in str(err.value)
    assert f"{folder / 'data-00001-of-00002.arrow'} row 1: 'prompt' is null" in str(err.value)
    index, report = index_rows(folder, "prompt", on_bad_row="skip")
    assert len(index) == 7 and report.reasons["null: prompt"].examples[0]["line"] == 1


def test_dataset_dict_splits_by_suffix_or_by_purpose(tmp_path: Path) -> None:
    folder = save_dict_to_disk(tmp_path / "dd", {"train": ROWS[:5], "validation": ROWS[5:6], "test": ROWS[6:]})
    train, _ = load_rows(folder, "prompt")  # data.train_files: the train split
    assert [r["ground_truth"] for r in train] == ["1", "2", "3", "4", "5"]
    val, _ = load_rows(folder, "prompt", purpose="val")  # data.val_files: validation before test
    assert [r["ground_truth"] for r in val] == ["6"]
    test, _ = load_rows(f"{folder}:test", "prompt")
    assert [r["ground_truth"] for r in test] == ["7"]
    with pytest.raises(DataError, match=r"has no split 'dev'; its splits are train, validation, test\. Name one"):
        load_rows(f"{folder}:dev", "prompt")
    with pytest.raises(DataError, match=r"is a single Dataset \(state.json\), which has no splits; drop ':train'"):
        load_rows(f"{folder}/train:train", "prompt")
    only = save_dict_to_disk(tmp_path / "only", {"eval": ROWS[:2]})  # one split: that one, whatever its name
    assert len(load_rows(only, "prompt")[0]) == 2


def test_an_ambiguous_dataset_dict_asks_for_the_split(tmp_path: Path) -> None:
    folder = save_dict_to_disk(tmp_path / "dd", {"a": ROWS[:2], "b": ROWS[2:]})
    with pytest.raises(DataError) as err:
        load_rows(folder, "prompt")
    assert f"{folder} is a DatasetDict with splits a, b and none is named train; name the split to read, " \
           f"e.g. {folder}:a" in str(err.value)


def test_the_trainer_reads_train_and_val_from_one_dataset_dict(tmp_path: Path) -> None:
    folder = save_dict_to_disk(tmp_path / "dd", {"train": ROWS[:5], "test": ROWS[5:]})
    config = build_config({"data": {"train_files": [str(folder)], "val_files": [str(folder)]}})
    split = split_train_val(config, "prompt")
    train, val = split.rows()
    assert (len(train), len(val)) == (5, 2) and not split.problems
    config = build_config({"data": {"train_files": [f"{folder}:test"]}})
    assert len(split_train_val(config, "prompt").rows()[0]) == 2


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: (d / "data-00000-of-00001.arrow").write_bytes(b"x"),
         r"holds Arrow files \(data-00000-of-00001.arrow\) but no state.json: an unknown layout \(found: "
         r"data-00000-of-00001.arrow\)\. Expected a Hugging Face save_to_disk folder is either a Dataset"),
        (lambda d: (d / "dataset_info.json").write_text("{}"),
         r"holds dataset_info.json but no state.json or dataset_dict.json \(found: dataset_info.json\): an "
         r"incomplete Hugging Face dataset folder"),
        (lambda d: (d / "notes.txt").write_text("hi"),
         r"holds no data files \(found: notes.txt\)\. Expected .jsonl, .ndjson, .json, .parquet, .csv files "
         r"\(in it or its subfolders\), or a Hugging Face save_to_disk folder"),
        (lambda d: None, r"holds no data files \(found: nothing \(the folder is empty\)\)"),
        (lambda d: (d / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00002.arrow"}]}'),
         r"state.json lists data-00000-of-00002.arrow, which the folder does not hold \(found: state.json\)"),
        (lambda d: (d / "state.json").write_text('{"_fingerprint": "x"}'),
         r"state.json: expected '_data_files': \[\{\"filename\": \"data-00000-of-00001.arrow\"\}"),
        (lambda d: (d / "dataset_dict.json").write_text('{"splits": ["train"]}'),
         r"dataset_dict.json lists split 'train', but .*/train is not a Dataset folder \(no state.json; found: "
         r"nothing\)"),
    ],
    ids=["loose-arrow", "info-only", "no-data", "empty", "missing-shard", "bad-state", "missing-split"],
)
def test_a_folder_of_an_unknown_layout_says_what_it_found(tmp_path: Path, make, expected: str) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    make(folder)
    with pytest.raises(DataError, match=expected):
        expand_paths(folder)


def test_a_broken_shard_and_arrow_files_given_by_name(tmp_path: Path) -> None:
    folder = save_to_disk(tmp_path / "ds", ROWS)
    (folder / "data-00000-of-00001.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match=r"data-00000-of-00001.arrow: not a readable Arrow IPC file .*re-save"):
        load_rows(folder, "prompt")
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(tmp_path / "file_format.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)  # the Arrow IPC *file* format (a footer) is read as well as the stream format
    rows, _ = load_rows(tmp_path / "file_format.arrow", "prompt")
    index, _ = index_rows(tmp_path / "file_format.arrow", "prompt")
    assert len(rows) == 7 and list(index) == rows


def test_a_folder_of_save_to_disk_folders_and_files(tmp_path: Path) -> None:
    save_to_disk(tmp_path / "all" / "a_hf", ROWS[:3])
    _jsonl(tmp_path / "all" / "b.jsonl", ROWS[3:])
    rows, report = load_rows(tmp_path / "all", "prompt")
    assert len(rows) == 7 and report.files[-1].endswith("b.jsonl") and "dataset_info.json" not in str(report.files)


def test_real_save_to_disk_folders_when_datasets_is_installed(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=2)
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_rows(tmp_path / "ds", "prompt")[0]) == 7
    assert len(load_rows(tmp_path / "dd", "prompt", purpose="val")[0]) == 1
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == sorted(
        p.name for p in save_to_disk(tmp_path / "hand", ROWS, num_shards=2).iterdir())
