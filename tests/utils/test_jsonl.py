"""verl's own append-only JSON Lines files: a partial last line (a crash mid-write) is dropped with one warning
naming the file; a bad line before the last is corruption, an error naming file and line."""

from __future__ import annotations

import json
import warnings

import pytest

from verl.errors import VerlError
from verl.utils.jsonl import drop_partial_tail, read_jsonl

ROWS = [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.7}]


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail, encoding="utf-8")


def test_partial_last_line_is_dropped_with_one_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, ROWS, '{"step": 3, "rew')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: dropped a partial last line \(line 3") as record:
        assert read_jsonl(path) == ROWS
    assert len(record) == 1


def test_complete_file_reads_without_warning(tmp_path):
    path = tmp_path / "samples.jsonl"
    _write(path, ROWS, "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_jsonl(path) == ROWS


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n" + json.dumps(ROWS[1]) + "\n", encoding="utf-8")
    with pytest.raises(VerlError, match=r"metrics\.jsonl:2: not a JSON line"):
        read_jsonl(path)


def test_drop_partial_tail_lets_appends_start_on_their_own_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, ROWS, '{"step": 3, "rew')
    with pytest.warns(UserWarning, match="metrics.jsonl"):
        assert drop_partial_tail(path)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": 3}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_jsonl(path) == [*ROWS, {"step": 3}]
        assert not drop_partial_tail(path)  # nothing to do on a whole file
    path.write_text(json.dumps(ROWS[0]), encoding="utf-8")  # complete, only its newline missing: kept
    assert drop_partial_tail(path) and read_jsonl(path) == [ROWS[0]]


def test_verl_plot_reads_a_truncated_metrics_file(tmp_path, capsys):
    from verl.cli.main import main

    _write(tmp_path / "metrics.jsonl", ROWS, '{"step": 3, "reward/me')
    with pytest.warns(UserWarning, match="metrics.jsonl: dropped a partial last line") as record:
        code = main(["plot", str(tmp_path), "--keys", "reward/mean", "--no-png"])
    assert code == 0, capsys.readouterr()
    assert len([w for w in record if "partial last line" in str(w.message)]) == 1
    assert (tmp_path / "metrics.svg").is_file()
