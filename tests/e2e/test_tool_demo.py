"""The tool-use demo end to end on a small budget: warm start, GRPO on episodes, summary.json."""

import json

import pytest

from verl.config import load_config
from verl.trainer.tool_demo import run_tool_demo

pytestmark = pytest.mark.slow


def test_tool_demo_writes_its_summary(tmp_path):
    config = load_config("examples/tool_calculator.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.total_steps=2", "sft.steps=25", "env.kwargs.num_train=200",
        "env.kwargs.num_val=16", "data.train_batch_size=4", "rollout.n=4", "data.val_batch_size=16"])
    summary = run_tool_demo(config, sft_episodes=8, quiet=True)
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("accuracy_after_sft", "accuracy_after_rl", "tool_calls_correct_after_sft",
                "tool_calls_correct_after_rl", "wall_seconds"):
        assert 0 <= saved[key] and saved[key] == summary[key]
    assert saved["steps"] == 2 and saved["sft_steps"] == 25 and saved["sft_episodes"] == 8
