"""Rows without the ground truth a reward reads are bad rows, reported with their lines: by `verl data check`
(when other rows of the file have one) and at RL start-up (when a reward function reads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl.cli.data_cmd import EXIT_BAD_ROWS, main
from verl.errors import DataError

LACKING = (5, 12)  # 1-based lines without a ground truth


def _file(tmp_path: Path) -> Path:
    rows = [{"prompt": f"{i}+1=", **({} if i + 1 in LACKING else {"ground_truth": str(i + 1)})} for i in range(16)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_data_check_reports_rows_without_ground_truth(tmp_path, capsys):
    path = _file(tmp_path)
    assert main(["data", "check", str(path), "--kind", "prompt"]) == EXIT_BAD_ROWS
    out = capsys.readouterr().out
    assert "16 rows read, 14 kept, 2 dropped" in out
    assert "missing: ground_truth: 2 rows (lines 5, 12)" in out
    assert f"{path}:5: no ground truth, though 14 other rows have one" in out
    assert "fix: add 'ground_truth' to every row" in out and "status: not clean" in out


def test_a_file_where_no_row_has_a_ground_truth_is_clean_unless_one_is_required(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"hi {i}"}) + "\n" for i in range(4)), encoding="utf-8")
    assert main(["data", "check", str(path), "--kind", "prompt"]) == 0
    assert "status: clean" in capsys.readouterr().out
    assert main(["data", "check", str(path), "--kind", "prompt", "--require-ground-truth"]) == EXIT_BAD_ROWS
    out = capsys.readouterr().out
    assert "missing: ground_truth: 4 rows (lines 1, 2, 3, 4)" in out
    assert f"{path}:1: no ground truth, and --require-ground-truth says the reward reads one" in out
    assert main(["data", "check", str(path), "--kind", "sft", "--require-ground-truth"]) == 2  # a wrong kind
    assert "--require-ground-truth checks prompt rows" in capsys.readouterr().err


def reads_truth(prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
    return float(response.strip() == str(ground_truth))


def test_rl_start_up_reports_them(tmp_path):
    from tiny_support import tiny_run_config

    from verl.trainer.rl_trainer import RLTrainer

    config = tiny_run_config(tmp_path / "run", "data.train_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=3",
                             f"data.train_files=[{_file(tmp_path)}]")
    config.reward.functions = [{"name": f"{Path(__file__).resolve()}:reads_truth"}]
    with pytest.raises(DataError, match=r"train data: 2 row\(s\) have no ground truth, but reward function\(s\) "
                                        r"reads_truth need one to score them: .*train\.jsonl:5, .*train\.jsonl:12"):
        RLTrainer(config)
