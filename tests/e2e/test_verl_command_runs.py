"""A volcengine/verl command line, translated, reaches two training steps on this CPU with the printed
suffix: the promise `python -m verl.trainer.main_ppo` makes to a user trying a script before the GPUs."""

from __future__ import annotations

import json
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.cli.main import main as verl_main
from verl.compat.command import cpu_command, translate_command

ARR = "actor_rollout_ref"


def _verl_parquet(path, rows: int) -> str:
    """Rows with verl's columns: the prompt as a chat list, reward_model.ground_truth, data_source."""
    table = [{"data_source": "openai/gsm8k", "ability": "math",
              "prompt": [{"role": "user", "content": f"What is {i}+{i}? Answer after ####."}],
              "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
             for i in range(rows)]
    pq.write_table(pa.Table.from_pylist(table), path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("launch, estimator", [
    (["python3", "-m", "verl.trainer.main_ppo"], "gae"),
    (["ray", "job", "submit", "--", "python3", "-m", "recipe.dapo.main_dapo"], "grpo"),
])
def test_a_translated_verl_run_reaches_two_steps_with_the_cpu_suffix(launch, estimator, tmp_path):
    train, val = _verl_parquet(tmp_path / "train.parquet", 8), _verl_parquet(tmp_path / "test.parquet", 2)
    items = [f"algorithm.adv_estimator={estimator}", f"data.train_files={train}", f"data.val_files={val}",
             "data.train_batch_size=1024", "data.max_response_length=1024", "data.filter_overlong_prompts=True",
             f"{ARR}.model.path=Qwen/Qwen2-7B-Instruct", f"{ARR}.actor.ppo_mini_batch_size=256",
             f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.actor.ppo_max_token_len_per_gpu=4096",
             f"{ARR}.rollout.name=vllm", f"{ARR}.rollout.n=5", f"{ARR}.rollout.top_k=-1",
             "critic.model.path=deepseek-ai/deepseek-llm-7b-chat", "reward_model.overlong_buffer.enable=True",
             "reward_model.overlong_buffer.len=512", "trainer.logger=['console','wandb']",
             "trainer.n_gpus_per_node=8", "trainer.save_freq=-1", "trainer.test_freq=5", "trainer.total_epochs=15"]
    _, translation = translate_command([*launch, *items])
    words = shlex.split(cpu_command(translation))
    assert words[:2] == ["verl", "train"]
    assert verl_main([*words[1:], f"trainer.run_dir={tmp_path / 'run'}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(row.get("step", 0) for row in rows) == 2
