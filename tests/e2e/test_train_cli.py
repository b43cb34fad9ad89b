"""`verl train` as a user runs it: a subprocess, a YAML file, a JSONL prompt file, a built-in reward."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl.checkpoint import list_checkpoints
from verl.cli.main import main as verl_main
from verl.config import load_config
from verl.demos.arithmetic import SFT_TARGET_ACCURACY

CONFIG = """\
model:
  path: tiny
  dtype: float32
data:
  train_files: [prompts.jsonl]      # relative to this file, not to the working directory
  train_batch_size: 4
  max_prompt_length: 32
reward:
  functions: [{name: numeric_match}]
rollout:
  n: 4
  max_new_tokens: 4
actor:
  lr: 1.0e-3
  micro_batch_size: 8
checkpoint:
  save_interval: 1
trainer:
  total_steps: 2
  device: cpu
  val_before_train: false
  run_dir: {run_dir}
logging:
  backends: [jsonl]
"""


def _verl(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "verl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's folder: config and data side by side; commands run from elsewhere."""
    folder = tmp_path / "project"
    folder.mkdir()
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3) for b in range(3)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "grpo.yaml").write_text(CONFIG.replace("{run_dir}", str(tmp_path / "run")), encoding="utf-8")
    (tmp_path / "elsewhere").mkdir()
    return folder


def test_train_yaml_with_jsonl_and_numeric_match(project):
    run_dir = project.parent / "run"
    proc = _verl("train", str(project / "grpo.yaml"), cwd=project.parent / "elsewhere")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run directory: {run_dir}" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"reward/mean", "reward/numeric_match/score", "actor/pg_loss", "timing/step"} <= rows[0].keys()
    infos = list_checkpoints(run_dir)
    assert [i.step for i in infos] == [1, 2] and all(i.problems == [] for i in infos)
    # the run directory records the resolved config, which loads back to the same run
    saved = load_config(str(run_dir / "config.yaml"))
    assert saved.trainer.total_steps == 2 and saved.reward.functions == [{"name": "numeric_match"}]



@pytest.mark.slow
def test_train_again_resumes_and_extends(project):
    run_dir = project.parent / "run"
    assert _verl("train", str(project / "grpo.yaml"), cwd=project).returncode == 0
    # the same command with more steps resumes (trainer.resume=auto) instead of starting over
    again = _verl("train", str(project / "grpo.yaml"), "trainer.total_steps=3", cwd=project)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [i.step for i in list_checkpoints(run_dir)] == [1, 2, 3]


def test_train_reports_bad_batch_arithmetic_without_traceback(project, capsys):
    code = verl_main(["train", str(project / "grpo.yaml"), "actor.mini_batch_size=3"])
    assert code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "ConfigError" in err and "data.train_batch_size=4 is not a multiple of actor.mini_batch_size=3" in err
    assert "Traceback" not in err
    assert not (project.parent / "run").exists()


def test_print_config_of_the_demo(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert verl_main(["train", "--print-config", "trainer.total_steps=7"]) == 0
    printed = capsys.readouterr().out
    tree = yaml.safe_load(printed)
    assert tree["env"]["name"] == "arithmetic" and tree["model"]["path"] == "tiny"
    assert tree["algorithm"]["adv_estimator"] == "grpo"
    assert tree["trainer"]["total_steps"] == 7  # overrides apply on top of the demo preset
    assert not list(tmp_path.iterdir())  # printing trains nothing and writes nothing
    # what is printed is a complete config: it loads back to the same values
    (tmp_path / "printed.yaml").write_text(printed, encoding="utf-8")
    again = load_config(str(tmp_path / "printed.yaml"))
    assert again.trainer.total_steps == 7 and again.rollout.n == tree["rollout"]["n"]


@pytest.mark.slow
def test_demo_with_fewer_steps(tmp_path):
    run_dir = tmp_path / "demo"
    proc = _verl("train", "trainer.total_steps=4", "trainer.val_every=2", "sft.steps=10", "env.kwargs.num_val=32",
                 "data.train_batch_size=8", f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]",
                 cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and 0.0 <= summary["accuracy_after_rl"] <= 1.0
    assert {"generate", "update"} <= summary["seconds_per_stage"].keys()
    assert "held-out accuracy after GRPO" in proc.stdout
    # the warm start reports progress while it runs, and the gain is in percentage points
    target = f"reaches {SFT_TARGET_ACCURACY:.0%} (at most 10 steps)"
    assert f"warm start: SFT until greedy accuracy on training problems {target}" in proc.stdout
    assert re.search(r"^warm start: SFT step 10/10  eta \S+  loss=[\d.]+  train/accuracy=[\d.]+$", proc.stdout, re.M)
    gain = (summary["accuracy_after_rl"] - summary["accuracy_after_sft"]) * 100
    assert re.search(r"│ gain\s+│\s+" + re.escape(f"{gain:+.1f} pts") + " │", proc.stdout), proc.stdout[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "val/accuracy" in rows[0]
