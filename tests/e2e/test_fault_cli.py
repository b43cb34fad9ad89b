"""Issue 45's faults end to end, from the command line as a user meets them: a reward that raises, a full disk in
a save, a metrics.jsonl cut mid-line by a crash, a garbage manifest. Each ends in one line (no traceback), loses
no finished step, and the same command with trainer.resume=auto goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REWARD = """
import os

def flaky(prompt, response, ground_truth, **meta):
    if os.environ.get("VERL_TEST_REWARD_FAILS_AT") and _count() >= int(os.environ["VERL_TEST_REWARD_FAILS_AT"]):
        raise ValueError("the reward service is down")
    return float(response.strip()[:1].isdigit())


def _count():
    path = os.environ["VERL_TEST_CALLS"]
    with open(path, "a") as f:
        f.write("x")
    return os.path.getsize(path)
"""

# the checkpoint writer fails with ENOSPC when it writes step 3 (a disk that fills up mid-run)
DISK_FULL = """
import errno, sys
import verl.checkpoint.manager as manager
from verl.cli.main import main

write = manager._dcp_save
def full_at_step_3(state, path, *rest):
    if "step_3" in str(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return write(state, path, *rest)
manager._dcp_save = full_at_step_3
raise SystemExit(main(sys.argv[1:]))
"""


def _project(tmp_path: Path, steps: int, **checkpoint) -> Path:
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 2, "max_prompt_length": 16},
        "reward": {"functions": [{"name": f"{tmp_path / 'reward.py'}:flaky"}]},
        "rollout": {"n": 2, "max_new_tokens": 2},
        "actor": {"lr": 1e-3, "micro_batch_size": 4},
        "checkpoint": {"save_interval": 1, **checkpoint},
        "trainer": {"total_steps": steps, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False, "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _verl(tmp_path: Path, *args: str, script: str | None = None, **env: str) -> subprocess.CompletedProcess:
    entry = ["-c", script] if script else ["-m", "verl.cli.main"]
    return subprocess.run([sys.executable, *entry, "train", *args], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                             "VERL_TEST_CALLS": str(tmp_path / "calls"), **env})


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "actor/grad_norm" in json.loads(line)]


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    """The one error the run ended with (a reward's adds the line of the user's code that raised), no traceback."""
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    starts = [i for i, line in enumerate(out.stderr.splitlines()) if line.startswith("error")]
    assert len(starts) == 1, out.stderr[-3000:]
    return "\n".join(out.stderr.splitlines()[starts[0]:])


def test_a_reward_that_raises_saves_the_last_finished_step_and_the_run_resumes(tmp_path):
    cfg = _project(tmp_path, 4, save_interval=5)
    # 2 prompts x 2 samples = 4 reward calls a step: the 9th call is step 3's first
    line = _one_line_error(_verl(tmp_path, str(cfg), VERL_TEST_REWARD_FAILS_AT="9"))
    assert "the reward service is down" in line and "saved step 2" in line and "trainer.resume=auto" in line, line
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    done = _verl(tmp_path, str(cfg), "trainer.resume=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(tmp_path / "run") == [1, 2, 3, 4]


def test_a_full_disk_in_a_save_names_the_last_checkpoint_and_the_run_resumes(tmp_path):
    cfg = _project(tmp_path, 4)
    line = _one_line_error(_verl(tmp_path, str(cfg), script=DISK_FULL))
    root = tmp_path / "run" / "checkpoints"
    assert "no space left on device" in line.lower() and f"last verified checkpoint: {root / 'step_2'}" in line, line
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]  # nothing half-written
    done = _verl(tmp_path, str(cfg), "trainer.resume=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / "step_4").is_dir()


def test_a_metrics_line_cut_by_a_crash_and_a_garbage_manifest_do_not_stop_a_resume(tmp_path):
    cfg = _project(tmp_path, 2)
    assert _verl(tmp_path, str(cfg)).returncode == 0
    run = tmp_path / "run"
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[: len(text) - 20])  # the last row cut mid-write
    (run / "checkpoints" / "step_2" / "manifest.json").write_text("{ not json")
    out = _verl(tmp_path, str(cfg), "trainer.total_steps=3", "trainer.resume=auto")
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert log.count("skipped a checkpoint that does not verify") == 1 and "resuming from" in log
    assert log.count("metrics.jsonl: dropped a partial last line") == 1
    assert _steps(run) == [1, 2, 3]  # step 2 retrained from step_1; the cut row dropped, not a JSON error
