"""`python -m verl.trainer.main_ppo ...`, a volcengine/verl command line, is answered with the same run as a
`verl train` command, the settings to decide and those with nothing here; it never starts a run."""

from __future__ import annotations

import shlex
import subprocess
import sys

from verl.config import load_config
from verl.config.verl_command import is_our_key, translate, translate_sft
from verl.rewards import BUILTIN_REWARDS
from verl.trainer import fsdp_sft_trainer
from verl.trainer.main_ppo import main

# verl's GSM8K GRPO example, shortened
VERL_GRPO = [
    "algorithm.adv_estimator=grpo", "data.train_files=train.jsonl", "data.train_batch_size=8",
    "data.max_prompt_length=64", "data.max_response_length=16", "data.filter_overlong_prompts=True",
    "data.truncation=left", "actor_rollout_ref.model.path=tiny", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=4",
    "trainer.logger=['console']", "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.total_epochs=3",
    "+trainer.val_before_train=False", "custom_reward_function.path=reward.py", "data.prompt_key=question",
]


def test_a_verl_command_becomes_ours_where_the_meaning_is_the_same():
    t = translate(VERL_GRPO)
    ours = dict(item.split("=", 1) for item in t.ours)
    assert ours["model.path"] == "tiny" and ours["actor.lr"] == "1e-6" and ours["rollout.n"] == "4"
    assert ours["rollout.max_new_tokens"] == "16" and "data.max_response_length" not in ours  # verl's meaning
    # truncation=left as ours, then filter_overlong_prompts' drop after it, so it wins (verl filters first)
    assert [i for i in t.ours if i.startswith("data.truncation=")] == ["data.truncation=truncate_left",
                                                                          "data.truncation=drop"]
    assert ours["rollout.engine"] == "vllm"
    assert ours["actor.mini_batch_size"] == "4" and ours["actor.micro_batch_size"] == "8"
    assert ours["actor.kl_loss_coef"] == "0.01" and ours["actor.kl_loss_type"] == "low_var_kl"
    assert ours["reward.functions"] == "[{name: reward.py:compute_score}]"  # verl's default name
    assert ours["trainer.val_before_train"] == "False" and ours["devices.num_gpus_per_node"] == "2"
    assert ours["data.fields.prompt"] == "question"
    assert t.flags == ["--nproc 2"]
    assert [theirs for theirs, _ in t.decide] == ["trainer.total_epochs=3"]
    assert t.missing == ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"]
    # the printed command is one our loader takes, with the user's values
    words = shlex.split(t.command())
    assert words[:4] == ["verl", "train", "--nproc", "2"] and words[4:] == t.ours
    config = load_config(None, t.ours)
    assert config.data.truncation == "drop"
    assert config.actor.kl_loss_coef == 0.01 and config.actor.kl_loss_type == "k3" and config.rollout.max_new_tokens == 16
    assert config.reward.functions == [{"name": "reward.py:compute_score"}]


def test_verls_kl_loss_is_off_unless_use_kl_loss_says_so():
    """In verl kl_loss_coef does nothing without use_kl_loss=True; here a coefficient > 0 turns the loss on."""
    alone = translate(["actor_rollout_ref.actor.kl_loss_coef=0.1"])
    assert alone.ours == [] and alone.decide[0][0] == "actor_rollout_ref.actor.kl_loss_coef=0.1"
    assert "actor.kl_loss_coef=0.001" in translate(["actor_rollout_ref.actor.use_kl_loss=true"]).ours  # verl's default


def test_settings_whose_meaning_differs_are_left_to_decide():
    t = translate(["data.truncation=middle", "actor_rollout_ref.rollout.name=sglang", "trainer.nnodes=2",
                   "custom_reward_function.name=score", "~trainer.logger"])
    assert [theirs for theirs, _ in t.decide] == ["data.truncation=middle", "actor_rollout_ref.rollout.name=sglang",
                                                  "custom_reward_function.name=score"]
    assert t.flags == ["--nnodes 2"] and t.missing == ["~trainer.logger"] and t.ours == []


def test_without_a_custom_reward_function_the_scorers_are_to_be_named():
    """verl scores by data_source when no custom_reward_function is given; here the functions are named, and
    the suggested override is one our loader takes, with every function a built-in."""
    t = translate(["data.train_files=train.parquet", "actor_rollout_ref.model.path=tiny"])
    (theirs, ours), = t.decide
    assert "no custom_reward_function" in theirs and "data_sources" in ours
    suggested = ours.split("'")[1]
    config = load_config(None, [*t.ours, suggested])
    assert [f["name"] for f in config.reward.functions] == ["numeric_match", "math_verify"]
    assert {f["name"] for f in config.reward.functions} <= set(BUILTIN_REWARDS)
    assert translate(["custom_reward_function.path=r.py"]).decide == []
    assert translate(["reward.functions=[{name: numeric_match}]"]).decide == []


def test_our_keys_are_known_by_the_schema():
    assert is_our_key("actor.lr") and is_our_key("env.kwargs.max_operand") and is_our_key("data.fields.prompt")
    assert not is_our_key("actor.optim.lr") and not is_our_key("actor") and not is_our_key("nope.lr")


def test_main_ppo_prints_the_run_and_starts_nothing(capsys):
    assert main(VERL_GRPO) == 2
    err = capsys.readouterr().err
    assert "Nothing was started" in err and "verl train --nproc 2 " in err and "actor.lr=1e-6" in err
    assert "trainer.total_epochs=3  ->  trainer.total_steps" in err and "gpu_memory_utilization=0.6" in err
    out = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "actor_rollout_ref.model.path=tiny"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "verl train model.path=tiny" in out.stderr


def test_a_verl_sft_command_becomes_an_sft_run_here(capsys, monkeypatch):
    items = ["data.train_files=sft.jsonl", "data.prompt_key=extra_info", "data.response_key=extra_info",
             "data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']",
             "data.micro_batch_size_per_gpu=4", "data.train_batch_size=8", "model.partial_pretrain=tiny",
             "optim.lr=1e-4", "trainer.total_epochs=2", "data.max_length=64", "model.fsdp_config.model_dtype=bf16"]
    t = translate_sft(items)
    ours = dict(item.split("=", 1) for item in t.ours)
    assert ours["trainer.kind"] == "sft" and ours["data.kind"] == "sft" and ours["model.path"] == "tiny"
    assert ours["data.fields.input"] == "extra_info.question" and ours["data.fields.output"] == "extra_info.answer"
    assert ours["sft.lr"] == "1e-4" and ours["sft.epochs"] == "2" and ours["sft.batch_size"] == "8"
    assert ours["actor.micro_batch_size"] == "4"
    assert [theirs for theirs, _ in t.decide] == ["data.max_length=64"]
    assert t.missing == ["model.fsdp_config.model_dtype=bf16"]
    config = load_config(None, t.ours)
    assert config.trainer.kind == "sft" and config.data.fields == {"input": "extra_info.question",
                                                                   "output": "extra_info.answer"}
    chat = translate_sft(["data.multiturn.enable=true", "data.multiturn.messages_key=conversation"])
    assert "data.fields.messages=conversation" in chat.ours
    monkeypatch.setenv("RANK", "1")  # under torchrun only rank 0 prints
    assert fsdp_sft_trainer.main(items) == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert fsdp_sft_trainer.main(items) == 2
    assert "verl train trainer.kind=sft data.kind=sft" in capsys.readouterr().err


def test_dapos_overlong_buffer_is_one_setting_here():
    on = translate(["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=512",
                    "reward_model.overlong_buffer.penalty_factor=1.0"])
    assert "algorithm.overlong_buffer=512" in on.ours and "algorithm.overlong_penalty=1.0" in on.ours
    off = translate(["reward_model.overlong_buffer.len=512"])  # verl ignores the length without enable=True
    assert off.ours == [] and off.decide[0][0] == "reward_model.overlong_buffer.len=512"


def test_gspo_is_the_sequence_importance_ratio_here():
    t = translate(["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.rollout.name='vllm'"])
    assert t.ours == ["actor.importance_sampling=sequence", "rollout.engine=vllm"]
    assert translate(["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"]).decide[0][1].startswith(
        "actor.importance_sampling")
