"""A training run whose reward executes hostile code: `verl train` with a `code_exec` program that forks,
leaves a child behind and sleeps past its timeout on every sample. The run finishes, every sample scores 0
with the reason in samples.jsonl, and no process of the run's sandbox uids is left alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from verl.sandbox import isolation
from verl.sandbox.isolation import SANDBOX_UID_BASE

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = ("import os, time\nfor _ in range(20):\n    try:\n        if os.fork() == 0:\n            os.setsid()\n"
           "            time.sleep(60)\n    except OSError:\n        pass\ntime.sleep(60)  # {code}")


def live_sandbox_processes(launcher_pid: int) -> list[int]:
    low = SANDBOX_UID_BASE + 1 + (launcher_pid % 500) * 200  # the uids that process gave its runs
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            owner = os.stat(f"/proc/{entry}").st_uid
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if low <= owner < low + 200 and state != "Z":
            found.append(int(entry))
    return found


def test_a_run_survives_hostile_code_and_records_why_each_sample_scored_zero(tmp_path):
    run_dir = tmp_path / "run"
    config = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "reward": {"functions": [{"name": "code_exec", "kwargs": {"program": HOSTILE, "timeout_s": 1}}],
                   "workers": 8},
        "data": {"train_batch_size": 2}, "rollout": {"n": 2, "max_new_tokens": 3},
        "trainer": {"total_steps": 1, "device": "cpu", "val_before_train": False, "log_samples": 4,
                    "run_dir": str(run_dir)},
        "logging": {"backends": ["console", "jsonl"]},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    sandboxes = tmp_path / "tmp"  # the run's private folders go here (TMPDIR), and must all be removed
    sandboxes.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(sandboxes)}
    proc = subprocess.Popen([sys.executable, "-m", "verl.cli", "train", str(tmp_path / "cfg.yaml")], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert isolation().describe() in out.splitlines()  # the banner says what isolation the code gets
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["score"] == 0.0 for s in samples)
    for s in samples:
        assert s["reward_extras"]["code_exec"] == {
            "status": "timeout", "reason": "test 1 of 1: ran past the 1 s wall-clock limit and was killed"}
    assert not list(sandboxes.glob("verl-sandbox-*"))
    if isolation().own_user:
        assert live_sandbox_processes(proc.pid) == []
