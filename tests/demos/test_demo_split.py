"""The arithmetic demo (`trainer.demo: arithmetic`) on 2 gloo processes with a rollout rank of its own, as `verl
train trainer.demo=arithmetic devices.actor=[0] devices.rollout=[1] rollout.max_staleness=1 --nproc 2` runs it:
the warm start on the actor's rank while the rollout rank waits, then asynchronous GRPO and one summary.

With rollout.max_staleness=0 the run is the one-process demo exactly (every metric of every step equal): the
warm start on the actor's rank is the one-process warm start, and the rollout rank samples with the warmed
weights (delivered at the first step), not the initial ones."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from verl.demos.arithmetic import demo_config_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from launch_support import metrics, verl_train  # noqa: E402 - `verl train` on N gloo processes (tests/distributed)

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _demo_config(tmp_path: Path, name: str, *, rollout_rank: bool, k: int = 1) -> Path:
    """The demo preset, shrunk: 20 warm-start steps (2 probes), 4 GRPO steps of 8 prompts x 4 samples."""
    cfg = yaml.safe_load(Path(demo_config_path()).read_text())
    cfg["env"]["kwargs"]["num_val"] = 32
    cfg["data"]["train_batch_size"] = 8
    cfg["rollout"]["n"] = 4
    cfg["sft"]["steps"] = 20
    cfg["trainer"] |= {"total_steps": 4, "val_every": 2, "device": "cpu", "run_dir": str(tmp_path / name)}
    cfg["logging"] = {"backends": ["jsonl"]}
    if rollout_rank:
        cfg["devices"] = {"actor": [0], "rollout": [1]}
        cfg["rollout"]["max_staleness"] = k
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_demo_runs_with_a_rollout_rank(tmp_path):
    verl_train(_demo_config(tmp_path, "async", rollout_rank=True, k=1), tmp_path, nproc=2)
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["sft_steps"] == 20 and summary["steps"] == 4
    assert 0.0 <= summary["accuracy_after_sft"] <= 1.0 and 0.0 <= summary["accuracy_after_rl"] <= 1.0
    rows = metrics(tmp_path / "async")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and "val/accuracy" in rows[0]
    steps = rows[1:]
    # the rollout rank generated every batch (its own stage times), one update ahead after the first step
    assert all(r["async/rollout_generate"] > 0 and r["async/weight_delivery_mb"] > 0 for r in steps)
    assert [r["async/staleness"] for r in steps] == [0.0, 1.0, 1.0, 1.0]


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "async/"))}


def test_staleness_zero_is_the_one_process_demo_exactly(tmp_path):
    verl_train(_demo_config(tmp_path, "one", rollout_rank=False), tmp_path, nproc=1)
    verl_train(_demo_config(tmp_path, "split", rollout_rank=True, k=0), tmp_path, nproc=2)
    one, split = metrics(tmp_path / "one"), metrics(tmp_path / "split")
    assert [_numbers(r) for r in split] == [_numbers(r) for r in one]
    assert all(r["async/staleness"] == 0.0 for r in split[1:])
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("one", "split")]
    keys = ("accuracy_after_sft", "accuracy_after_rl", "sft_steps", "steps")
    assert [s[k] for k in keys for s in summaries[:1]] == [s[k] for k in keys for s in summaries[1:]]
