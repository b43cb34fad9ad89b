"""The vision demo end to end on a small budget: warm start on pictures, GRPO, summary.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl.config import load_config
from verl.errors import ConfigError

pytest.importorskip("PIL")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trainer.total_steps=2", "trainer.val_every=2", "sft.steps=10", "sft.batch_size=8",
         "env.kwargs.num_train=64", "env.kwargs.num_val=8", "data.train_batch_size=4", "rollout.n=4",
         "data.val_batch_size=8", "actor.mini_batch_size=4"]


def test_vision_demo_writes_its_summary(tmp_path):
    from verl.demos.vision import run_vision_demo

    config = load_config(str(ROOT / "examples" / "vision_shapes.yaml"), [f"trainer.run_dir={tmp_path}", *SMALL])
    summary = run_vision_demo(config)
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("accuracy_after_sft", "accuracy_after_rl", "sft_probe_accuracy"):
        assert 0 <= saved[key] <= 1 and saved[key] == summary[key]
    assert saved["accuracy_gain"] == pytest.approx(saved["accuracy_after_rl"] - saved["accuracy_after_sft"])
    assert saved["steps"] == 2 and 0 < saved["sft_steps"] <= 10


def test_vision_demo_refuses_a_text_environment(tmp_path):
    from verl.demos.vision import run_vision_demo

    config = load_config(str(ROOT / "examples" / "vision_shapes.yaml"), [
        f"trainer.run_dir={tmp_path}", "env.name=arithmetic", "env.kwargs={}", "model.path=tiny", *SMALL[:3]])
    with pytest.raises(ConfigError, match="vision"):
        run_vision_demo(config)


def test_verl_train_runs_the_vision_demo(tmp_path):
    """`verl train examples/vision_shapes.yaml` is the demo: the config's trainer.demo says so."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "verl.cli", "train", str(ROOT / "examples" / "vision_shapes.yaml"), *SMALL,
         f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verl vision demo" in proc.stdout and "held-out accuracy after SFT" in proc.stdout
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
