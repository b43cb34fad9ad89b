"""SIGKILL a training process at random moments while it saves; `resume=auto` must always recover.

The child saves every step (so most of its wall time is spent inside save: DCP write, fsyncs, manifest,
rename, `latest`). The parent kills it a random few milliseconds after a random ``SAVING <step>`` line,
then checks that every committed checkpoint verifies and that resuming reaches exactly the weights of an
uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.checkpoint.toy_train import train
from verl.checkpoint import list_checkpoints

SCRIPT = Path(__file__).with_name("toy_train.py")
TOTAL = 30
WIDTH = 256


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model, metrics = train(tmp_path_factory.mktemp("ref"), TOTAL, save_interval=0, width=WIDTH)
    return model.state_dict(), metrics


def _kill_during_save(run_dir: Path, rng: random.Random, async_save: bool, latest_kill: int) -> int:
    """Start the child, SIGKILL it mid-save, return the step whose save was in flight."""
    kill_after = rng.randint(2, latest_kill)
    argv = [sys.executable, str(SCRIPT), str(run_dir), str(TOTAL), "1", "auto"] + (["async"] if async_save else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("SAVING") and int(line.split()[1]) >= kill_after:
                time.sleep(rng.uniform(0.0, 0.02))
                proc.send_signal(signal.SIGKILL)
                break
            assert not line.startswith("DONE"), "the child finished before it could be killed"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return kill_after


def _trial(tmp_path: Path, reference, seed: int, async_save: bool = False, latest_kill: int = 4) -> None:
    rng = random.Random(seed)
    run_dir = tmp_path / f"run{seed}"
    _kill_during_save(run_dir, rng, async_save, latest_kill)
    infos = list_checkpoints(run_dir)
    assert infos, "nothing was committed before the kill"
    for info in infos:  # no committed checkpoint may lie
        assert info.problems == [], info.problems
    # saving is not part of the maths, so the rest of the run saves rarely to keep the test fast
    model, metrics = train(run_dir, TOTAL, save_interval=10, resume="auto", width=WIDTH)
    ref_state, ref_metrics = reference
    assert metrics == ref_metrics
    assert all(torch.equal(v, ref_state[k]) for k, v in model.state_dict().items())
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]


def test_sigkill_one_trial(tmp_path, reference):
    _trial(tmp_path, reference, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 11))
def test_sigkill_ten_trials(tmp_path, reference, seed):
    _trial(tmp_path, reference, seed, async_save=seed % 2 == 0, latest_kill=TOTAL - 5)
