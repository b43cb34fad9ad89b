"""`verl train examples/agent_tools.yaml` end to end on a small budget, from another folder (the agent file is
found beside the config): warm start, GRPO on the agent's episodes through the endpoint, summary.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_verl_train_runs_the_agent_demo(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # this checkout's verl
    proc = subprocess.run(
        [sys.executable, "-m", "verl.cli", "train", str(ROOT / "examples" / "agent_tools.yaml"),
         "trainer.total_steps=2", "sft.steps=10", "env.kwargs.num_train=300", "env.kwargs.num_val=8",
         "data.train_batch_size=4", "rollout.n=4", f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm start: 10 SFT steps on 236 conversations (" in proc.stdout and " without the tool;" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["sft_steps"] == 10
    assert summary["cpu_matmul"] in ("aten", "onednn") and summary["cpu_matmul_why"]  # to reproduce it
    assert 0 <= summary["accuracy_after_rl"] <= 1 and summary["calls_per_episode_after_rl"] >= 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("episode/agent_calls" in m for m in metrics)
