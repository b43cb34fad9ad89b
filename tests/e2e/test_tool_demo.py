"""The tool-use demo end to end on a small budget: warm start, GRPO on episodes, summary.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.config import load_config
from verl.demos.tool import run_tool_demo

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_tool_demo_writes_its_summary(tmp_path):
    config = load_config("examples/tool_calculator.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.total_steps=2", "sft.steps=25", "env.kwargs.num_train=200",
        "env.kwargs.num_val=16", "data.train_batch_size=4", "rollout.n=4", "data.val_batch_size=16"])
    summary = run_tool_demo(config, sft_episodes=8, quiet=True)
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("accuracy_after_sft", "accuracy_after_rl", "tool_calls_correct_after_sft",
                "tool_calls_correct_after_rl", "wall_seconds"):
        assert 0 <= saved[key] and saved[key] == summary[key]
    assert saved["steps"] == 2 and saved["sft_steps"] <= 25 and saved["sft_episodes"] == 8


def test_verl_train_runs_the_tool_demo(tmp_path):
    """`verl train examples/tool_calculator.yaml` is the demo (warm start, GRPO, summary), as `verl train` is
    the built-in one: the config's trainer.demo says so."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # this checkout's verl
    proc = subprocess.run(
        [sys.executable, "-m", "verl.cli", "train", str(EXAMPLES / "tool_calculator.yaml"), "trainer.total_steps=2",
         "sft.steps=10", "env.kwargs.num_train=100", "env.kwargs.num_val=8", "data.train_batch_size=4",
         "rollout.n=4", f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm start: 10 SFT steps on 64 formatted episodes" in proc.stdout
    assert "held-out accuracy      after SFT" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["sft_steps"] == 10
    assert 0 <= summary["tool_calls_correct_after_rl"] <= 1
