"""The row index the trainers read: the same rows as loading them, read back from their files on demand,
Python `datasets.Dataset` objects (duck-typed) through the same checks, and a file rewritten mid-run refused."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_support import FakeBatchedDataset, FakeDataset, FakeIterableDataset, save_to_disk

from verl.data import index_dataset, index_rows, load_rows
from verl.data.hf import is_dataset, is_dataset_dict, is_streaming_dataset
from verl.data.index import row_facts, rows_at
from verl.errors import DataError

ROWS = [{"question": f"q{i}", "answer": str(i), "data_source": "a" if i % 2 else "b"} for i in range(10)]


def _mixed_files(tmp_path: Path) -> list[Path]:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\r\n\n" for r in ROWS[:3])
                      + b"{broken\n" + json.dumps({"prompt": "long " * 20000}).encode() + b"\n")
    csv_file = tmp_path / "b.csv"
    csv_file.write_text('prompt,answer\n"two\nlines, quoted",5\nplain,6\n', encoding="utf-8")
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps(ROWS[3:5]))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[5:8]), parquet, row_group_size=2)
    arrow = save_to_disk(tmp_path / "e", ROWS[8:], num_shards=2)
    return [jsonl, csv_file, json_file, parquet, arrow]


def test_the_index_gives_the_rows_loading_gives(tmp_path: Path) -> None:
    files = _mixed_files(tmp_path)
    rows, report = load_rows(files, "prompt", on_bad_row="skip")
    index, same_report = index_rows(files, "prompt", on_bad_row="skip")
    assert report.to_dict() == same_report.to_dict() and same_report.reasons["malformed_json"].examples[0]["line"] == 7
    assert len(index) == len(rows) == 13 and list(index) == rows
    order = [12, 0, 7, 3, 3, 9, 5]  # a shuffled draw mixing every format, with a repeat
    assert rows_at(index, order) == [rows[i] for i in order]
    assert index[-1] == rows[-1] and index[4]["prompt"] == "two\nlines, quoted"
    assert [r["prompt"] for r in index[2:5]] == [r["prompt"] for r in rows[2:5]]
    assert list(pickle.loads(pickle.dumps(index))) == rows  # forked/spawned workers get a working copy
    with pytest.raises(IndexError):
        index[13]


def test_rows_are_fresh_dicts_and_the_index_is_small(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i} " + "x" * 200, "answer": str(i)}) + "\n"
                            for i in range(20000)))
    index, _ = index_rows(path, "prompt")
    first = index[0]
    first["prompt"] = "changed"
    first["metadata"]["x"] = 1
    assert index[0]["prompt"].startswith("p0 ") and index[0]["metadata"] == {}
    assert index.nbytes() <= 25 * len(index)  # ~24 bytes a row, not the row (~240 bytes of text here)
    sub = index.subset([19999, 5])
    assert [r["ground_truth"] for r in sub] == ["19999", "5"] and len(sub) == 2


def test_facts_give_data_sources_and_ground_truths_without_reading(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:3], {"prompt": "no answer"}]))
    index, _ = index_rows(path, "prompt")
    os.unlink(path)  # facts come from the index itself
    facts = list(row_facts(index))
    assert [(f.data_source, f.has_ground_truth, f.line) for f in facts] == [
        ("b", True, 1), ("a", True, 2), ("b", True, 3), (None, False, 4)]


def test_a_file_changed_after_the_check_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    index, _ = index_rows(path, "prompt")
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[::-1]) + "\n")
    with pytest.raises(DataError, match=r"a.jsonl changed \(or was removed\) after it was checked at start-up; .*"
                                        r"Restart the run to check it again"):
        index[0]


def test_a_python_dataset_goes_through_the_same_checks(tmp_path: Path) -> None:
    rows = [*ROWS[:3], {"question": "  ", "answer": "1"}, *ROWS[3:5]]
    for fake in (FakeDataset(rows), FakeBatchedDataset(rows)):
        assert is_dataset(fake) and not is_dataset(rows) and not is_dataset({"a": 1})
        with pytest.raises(DataError) as err:
            index_dataset(fake, "prompt")
        assert "1 of 6 rows are bad" in str(err.value) and "dataset[3]: 'prompt' is whitespace only" in str(err.value)
        index, report = index_dataset(fake, "prompt", on_bad_row="skip")
        assert [r["prompt"] for r in index] == ["q0", "q1", "q2", "q3", "q4"] and report.files == ["<dataset>"]
        assert index[3]["file"] == "<dataset>" and index[3]["line"] == 4  # the row's index in the dataset


def test_a_dataset_dict_gives_the_split_for_its_purpose_and_rows_as_python_objects() -> None:
    dd = {"train": FakeDataset(ROWS[:4], fmt="torch"), "validation": FakeDataset(ROWS[4:5])}
    assert is_dataset_dict(dd) and not is_dataset_dict({}) and not is_dataset_dict({"train": ROWS})
    train, _ = index_dataset(dd, "prompt", name="train_rows")
    assert len(train) == 4 and train[0]["file"] == "<train_rows['train']>"  # read with with_format(None)
    val, _ = index_dataset(dd, "prompt", name="val_rows", purpose="val")
    assert [r["prompt"] for r in val] == ["q4"]
    with pytest.raises(DataError, match=r"dataset is a DatasetDict with splits x, y and none is named train"):
        index_dataset({"x": FakeDataset(ROWS), "y": FakeDataset(ROWS)}, "prompt")


def test_a_streaming_dataset_is_refused_with_the_way_out() -> None:
    assert is_streaming_dataset(FakeIterableDataset())
    with pytest.raises(DataError, match=r"dataset is a streaming IterableDataset, which has no length .* save it "
                                        r"\(ds.save_to_disk\(PATH\)\) and set data.train_files"):
        index_dataset(FakeIterableDataset(), "prompt")
