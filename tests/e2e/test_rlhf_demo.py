"""The RLHF pipeline demo end to end on a small budget: SFT, a reward model exported and loaded by RL as its only
reward, GRPO, summary.json; validation measures the true accuracy next to the reward model's opinion."""

import json

import pytest

from verl.config import load_config
from verl.demos.rlhf import run_rlhf_demo

pytestmark = pytest.mark.slow


def test_rlhf_demo_trains_on_the_reward_model_alone(tmp_path):
    config = load_config("examples/rlhf_pipeline.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.total_steps=2", "trainer.val_every=0", "sft.steps=20",
        "env.kwargs.max_operand=19", "env.kwargs.num_val=16", "data.train_batch_size=4", "rollout.n=4",
        "data.val_batch_size=16", "actor.mini_batch_size=4", "logging.backends=[jsonl]"])
    summary = run_rlhf_demo(config, rm_steps=3, rm_batch_size=16, samples_per_problem=2, quiet=True)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert saved["steps"] == 2 and saved["sft_steps"] <= 20 and 0 <= saved["accuracy_after_rl"] <= 1
    # the reward model's budget ran out before its probe pairs reached the target (trainer.stop_when)
    assert saved["rm_steps"] == 3 and 0 <= saved["rm_probe_accuracy"] <= 1 and 0 <= saved["rm_pair_accuracy"] <= 1
    rm_rows = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rm_rows if "val/accuracy" in r] == [3]  # the probe, at the end (never before)
    rm_dir = tmp_path / "rm" / "reward_model"
    assert saved["reward_model"] == str(rm_dir) and (rm_dir / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert steps and all("reward/reward_model/score" in r for r in steps)
    assert not any(k.startswith("reward/numeric_match") for r in steps for k in r)  # no rule scores training
    val = [r for r in rows if "val/accuracy" in r]
    assert len(val) == 2 and all("val/training_reward" in r for r in val)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and all("training_reward" in s["reward_extras"] and s["score"] in (0, 1) for s in samples)
