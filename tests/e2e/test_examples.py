"""The shipped examples are consistent with the data next to them, and the quickstart runs offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.cli.main import main as verl_main
from verl.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["quickstart.yaml", "grpo_gsm8k.yaml", "ppo_gsm8k.yaml", "dapo_gsm8k.yaml"])
def test_example_data_fills_a_batch_and_validation_is_held_out(name: str) -> None:
    config = load_config(str(EXAMPLES / name))
    (train_file,), (val_file,) = config.data.train_files, config.data.val_files
    train, val = _rows(EXAMPLES / train_file), _rows(EXAMPLES / val_file)
    assert len(train) >= config.data.train_batch_size  # a step never repeats a prompt
    field = config.data.fields["prompt"]
    assert not {r[field] for r in train} & {r[field] for r in val}  # validation rows are not trained on


def test_quickstart_passes_every_check(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # its data paths resolve next to the YAML, not the working directory
    assert verl_main(["check", str(EXAMPLES / "quickstart.yaml")]) == 0
    out = capsys.readouterr().out
    assert "131/131 rows kept" in out and "24/24 rows kept" in out and "all checks passed" in out


@pytest.mark.slow
def test_quickstart_trains(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "verl.cli", "train", str(EXAMPLES / "quickstart.yaml"),
                           f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 100 and "val/accuracy" in rows[0] and "val/score" in rows[-1]
    assert {"reward/numeric_match/score", "reward/format/score"} <= rows[1].keys()
    # the digit bonus is learnt: from the untrained model's few digits to nearly always
    assert rows[1]["reward/format/score"] < 0.3 < 0.9 < rows[-1]["reward/format/score"]
