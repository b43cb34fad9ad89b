"""`RLTrainer.from_pretrained` as TRL users write it: the model section as a dict, peft's LoraConfig, a list
of reward functions mixing callables and spec names, TRL's `reward_funcs`."""

from __future__ import annotations

import pytest
import torch

from verl.errors import ConfigError
from verl.models.lora import is_peft_model
from verl.trainer.rl.python_api import lora_section, python_run
from verl.trainer.rl_trainer import RLTrainer

ROWS = [{"prompt": f"{a}+1=", "ground_truth": str(a + 1)} for a in range(4)]


def length_reward(prompt, response, ground_truth, **meta):
    return float(len(response) > 0)


def digit_reward(prompt, response, ground_truth, **meta):
    return float(any(c.isdigit() for c in response))


def _common(tmp_path) -> dict:
    return {"trainer.device": "cpu", "trainer.run_dir": str(tmp_path), "model.dtype": "float32",
            "data.train_batch_size": 2, "rollout.n": 2, "rollout.max_new_tokens": 2, "logging.backends": ["jsonl"],
            "trainer.val_before_train": False, "trainer.total_steps": 1}


def test_a_list_of_callables_and_a_model_section_with_lora(tmp_path):
    trainer = RLTrainer.from_pretrained({"path": "tiny", "lora": {"rank": 4}}, reward_fn=[length_reward, digit_reward],
                                        dataset=ROWS, **_common(tmp_path))
    assert trainer.config.model.path == "tiny" and trainer.config.model.lora.rank == 4
    assert is_peft_model(trainer.model)
    assert trainer.env.reward_manager.names == ["length_reward", "digit_reward"]
    metrics = trainer.step()
    assert "reward/length_reward/score" in metrics and "reward/digit_reward/score" in metrics


def test_callables_and_spec_names_mix_and_trls_names_are_accepted(tmp_path):
    peft = pytest.importorskip("peft")
    run = python_run("tiny", reward_fn=[digit_reward, "numeric_match"], dataset=ROWS,
                     peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                     overrides={"trainer.device": "cpu"})
    assert run.reward_functions == [digit_reward, {"name": "numeric_match"}] and run.config.reward.functions == []
    lora = run.config.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 16, ["q_proj", "v_proj"])
    named = python_run("tiny", reward_fn=["numeric_match"], dataset=None, peft_config=None, overrides={})
    assert [f["name"] for f in named.config.reward.functions] == ["numeric_match"] and named.reward_functions is None
    trainer = RLTrainer.from_pretrained("tiny", reward_funcs=[digit_reward, "numeric_match"], dataset=ROWS,
                                        **_common(tmp_path))
    assert trainer.env.reward_manager.names == ["digit_reward", "numeric_match"]


def test_argument_mistakes_say_what_to_pass(tmp_path):
    with pytest.raises(ConfigError, match="both reward_fn and reward_funcs"):
        RLTrainer.from_pretrained("tiny", reward_fn=digit_reward, reward_funcs=[digit_reward], dataset=ROWS)
    with pytest.raises(ConfigError, match="expected a peft LoraConfig"):
        lora_section(object())
    with pytest.raises(ConfigError, match=r"reward_fn=3 \(int\): pass a reward name"):
        python_run("tiny", reward_fn=3, dataset=None, peft_config=None, overrides={})
    with pytest.raises(ConfigError, match=r"model=3 \(int\): pass a path or hub id"):
        python_run(3, reward_fn=None, dataset=None, peft_config=None, overrides={})


def test_teacher_model_distils_as_in_trls_gkd(tmp_path):
    trainer = RLTrainer.from_pretrained("tiny", reward_fn=digit_reward, dataset=ROWS, teacher_model="tiny:qwen2:96:3",
                                        **_common(tmp_path))
    assert trainer.config.algorithm.distill.teacher_path == "tiny:qwen2:96:3" and trainer.teacher is not None
    assert trainer.step()["distill/reverse_kl"] != 0.0
    with pytest.raises(ConfigError, match=r"teacher_model=Linear: pass the teacher as a path or hub id"):
        python_run("tiny", reward_fn=None, dataset=None, peft_config=None, overrides={},
                   teacher_model=torch.nn.Linear(2, 2))
