"""`python -m verl.trainer.main_ppo ...`, a volcengine/verl command line, is answered with the same run as a
`verl train` command, the settings to decide and those with nothing here; it never starts a run."""

from __future__ import annotations

import runpy
import shlex
import sys
import warnings

import pytest

from verl.compat.command import is_our_key, translate, translate_sft
from verl.compat.main_ppo import NOTHING_STARTED
from verl.config import load_config
from verl.rewards import BUILTIN_REWARDS
from verl.trainer import fsdp_sft_trainer
from verl.trainer.main_ppo import main

ARR = "actor_rollout_ref"

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
    # filter_overlong_prompts' drop wins over truncation=left (verl filters first), and the key appears once
    assert [i for i in t.ours if i.startswith("data.truncation=")] == ["data.truncation=drop"]
    assert len({i.partition("=")[0] for i in t.ours}) == len(t.ours)
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
    assert (config.actor.kl_loss_coef == 0.01 and config.actor.kl_loss_type == "k3"
            and config.rollout.max_new_tokens == 16)
    assert config.reward.functions == [{"name": "reward.py:compute_score"}]


def test_verls_kl_loss_is_off_unless_use_kl_loss_says_so():
    """In verl kl_loss_coef does nothing without use_kl_loss=True; here a coefficient > 0 turns the loss on."""
    alone = translate(["actor_rollout_ref.actor.kl_loss_coef=0.1"])
    assert alone.ours == [] and alone.decide[0][0] == "actor_rollout_ref.actor.kl_loss_coef=0.1"
    assert "actor.kl_loss_coef=0.001" in translate(["actor_rollout_ref.actor.use_kl_loss=true"]).ours  # verl's default
    off = translate(["actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.001"])
    assert "actor.kl_loss_coef=0" in off.ours and not off.decide[:-1]  # (the last: the reward functions to name)
    assert off.notes == [("actor_rollout_ref.actor.kl_loss_coef=0.001",
                          "actor.kl_loss_coef=0: actor_rollout_ref.actor.use_kl_loss=False turns the KL loss off")]


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


def test_main_ppo_prints_the_run_on_stdout_and_starts_nothing(capsys, monkeypatch):
    assert main(VERL_GRPO) == NOTHING_STARTED != 0  # a script or CI job must not think it trained
    captured = capsys.readouterr()
    command, cpu = captured.out.splitlines()
    assert command.startswith("verl train --nproc 2 ") and "actor.lr=1e-6" in command
    assert cpu.startswith("# try it on this CPU: verl train --nproc 1 ") and "model.path=tiny" in cpu
    assert "Nothing was started" in captured.err and "gpu_memory_utilization=0.6" in captured.err
    assert "trainer.total_epochs=3  ->  trainer.total_steps" in captured.err
    assert _run_module("verl.trainer.main_ppo", "actor_rollout_ref.model.path=tiny", monkeypatch) == NOTHING_STARTED
    assert capsys.readouterr().out.startswith("verl train model.path=tiny")
    assert _run_module("verl.trainer.fsdp_sft_trainer", "model.partial_pretrain=tiny", monkeypatch) == NOTHING_STARTED
    assert capsys.readouterr().out.startswith("verl train trainer.kind=sft data.kind=sft model.path=tiny")


def _run_module(name: str, item: str, monkeypatch) -> int:
    """`python -m NAME ITEM` as a verl user types it, in this process (its `__main__` block included)."""
    monkeypatch.setattr(sys, "argv", [name, item])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as done:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already, as intended
        runpy.run_module(name, run_name="__main__")
    return done.value.code


def test_a_verl_sft_command_becomes_an_sft_run_here(capsys, monkeypatch):
    items = ["data.train_files=sft.jsonl", "data.prompt_key=extra_info", "data.response_key=extra_info",
             "data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']",
             "data.micro_batch_size_per_gpu=4", "data.train_batch_size=8", "model.partial_pretrain=tiny",
             "optim.lr=1e-4", "trainer.total_epochs=2", "data.max_length=64", "model.fsdp_config.model_dtype=bf16",
             "ulysses_sequence_parallel_size=2", "use_remove_padding=true"]
    t = translate_sft(items)
    ours = dict(item.split("=", 1) for item in t.ours)
    assert ours["trainer.kind"] == "sft" and ours["data.kind"] == "sft" and ours["model.path"] == "tiny"
    assert ours["data.fields.input"] == "extra_info.question" and ours["data.fields.output"] == "extra_info.answer"
    assert ours["sft.lr"] == "1e-4" and ours["sft.epochs"] == "2" and ours["sft.batch_size"] == "8"
    assert ours["actor.micro_batch_size"] == "4" and ours["actor.sequence_parallel_size"] == "2"
    assert [theirs for theirs, _ in t.decide] == ["data.max_length=64", "use_remove_padding=true"]
    assert t.missing == ["model.fsdp_config.model_dtype=bf16"]
    config = load_config(None, t.ours)
    assert config.trainer.kind == "sft" and config.data.fields == {"input": "extra_info.question",
                                                                   "output": "extra_info.answer"}
    chat = translate_sft(["data.multiturn.enable=true", "data.multiturn.messages_key=conversation"])
    assert "data.fields.messages=conversation" in chat.ours
    monkeypatch.setenv("RANK", "1")  # under torchrun only rank 0 prints
    assert fsdp_sft_trainer.main(items) == NOTHING_STARTED and capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    assert fsdp_sft_trainer.main(items) == NOTHING_STARTED
    assert capsys.readouterr().out.startswith("verl train trainer.kind=sft data.kind=sft")


def test_dapos_overlong_buffer_is_one_setting_here():
    on = translate(["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=512",
                    "reward_model.overlong_buffer.penalty_factor=1.0"])
    assert "algorithm.overlong_buffer=512" in on.ours and "algorithm.overlong_penalty=1.0" in on.ours
    off = translate(["reward_model.overlong_buffer.len=512"])  # verl ignores the length without enable=True
    assert off.ours == [] and off.decide[0][0] == "reward_model.overlong_buffer.len=512"


def test_gspo_is_the_sequence_importance_ratio_here():
    t = translate(["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.rollout.name='vllm'"])
    assert t.ours == ["actor.policy_loss=gspo", "rollout.engine=vllm"]
    assert translate(["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"]).ours == ["actor.policy_loss=gmpo"]
    assert translate(["actor_rollout_ref.actor.policy_loss.loss_mode=gpg"]).decide[0][1].startswith(
        "actor.policy_loss")


def _ours(t):
    return dict(item.split("=", 1) for item in t.ours)


def test_verls_minus_one_for_off_is_our_nearest_setting_with_a_note():
    t = translate(["trainer.save_freq=-1", "trainer.test_freq=-1", "actor_rollout_ref.rollout.top_k=-1",
                   "actor_rollout_ref.actor.tis_imp_ratio_cap=-1"])
    assert _ours(t) == {"checkpoint.save_interval": "0", "trainer.val_every": "0", "rollout.top_k": "0",
                        "actor.tis_cap": "null"}
    assert [theirs for theirs, _ in t.notes] == ["trainer.save_freq=-1", "trainer.test_freq=-1",
                                                 "actor_rollout_ref.rollout.top_k=-1",
                                                 "actor_rollout_ref.actor.tis_imp_ratio_cap=-1"]
    assert "final step still saves" in t.notes[0][1]
    config = load_config(None, t.ours)
    assert config.checkpoint.save_interval == 0 and config.actor.tis_cap is None
    assert _ours(translate(["trainer.save_freq=20"]))["checkpoint.save_interval"] == "20" and not translate(
        ["trainer.save_freq=20"]).notes


def test_the_dapo_recipes_overlong_buffer_cfg_is_the_same_setting():
    cfg = "+reward_model.reward_kwargs.overlong_buffer_cfg"
    t = translate([f"{cfg}.enable=True", f"{cfg}.len=4096", f"{cfg}.penalty_factor=0.5", f"{cfg}.log=False",
                   "+reward_model.reward_kwargs.max_resp_len=8192", "data.max_response_length=8192"])
    assert _ours(t) == {"algorithm.overlong_buffer": "4096", "algorithm.overlong_penalty": "0.5",
                        "rollout.max_new_tokens": "8192", **{k: v for k, v in _ours(t).items()
                                                             if k.startswith("reward.")}}
    assert t.missing == [f"{cfg}.log=False"] and all("max_resp_len" not in theirs for theirs, _ in t.decide)
    other = translate([f"{cfg}.enable=True", f"{cfg}.len=16", "+reward_model.reward_kwargs.max_resp_len=64",
                       "data.max_response_length=32"])
    assert any(theirs == "reward_model.reward_kwargs.max_resp_len=64" for theirs, _ in other.decide)


def test_a_key_given_twice_is_emitted_once_with_the_last_value():
    t = translate(["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=8",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16", "actor_rollout_ref.rollout.n=4",
                   "rollout.n=8", "data.truncation=left", "data.filter_overlong_prompts=True"])
    keys = [item.partition("=")[0] for item in t.ours]
    assert len(keys) == len(set(keys))
    assert _ours(t)["algorithm.overlong_buffer"] == "16" and _ours(t)["rollout.n"] == "8"
    assert _ours(t)["data.truncation"] == "drop"


def test_lr_warmup_steps_ratio_becomes_a_count_of_steps():
    ratio = f"{ARR}.actor.optim.lr_warmup_steps_ratio=0.1"
    t = translate([ratio, "trainer.total_training_steps=200", "critic.optim.lr_warmup_steps_ratio=0.05"])
    assert _ours(t)["actor.warmup_steps"] == "20" and _ours(t)["critic.warmup_steps"] == "10"
    assert _ours(t)["trainer.total_steps"] == "200" and t.notes[0][0] == ratio
    unknown_length = translate([ratio, "trainer.total_epochs=2"])
    assert "actor.warmup_steps" not in _ours(unknown_length)
    assert any(theirs == ratio and "ratio times trainer.total_steps" in ours for theirs, ours in unknown_length.decide)
    # verl uses lr_warmup_steps where it is set (not -1), and the ratio only where it is not
    assert _ours(translate([ratio, f"{ARR}.actor.optim.lr_warmup_steps=5", "trainer.total_training_steps=200"]))[
        "actor.warmup_steps"] == "5"
    assert "actor.warmup_steps" not in _ours(translate([f"{ARR}.actor.optim.lr_warmup_steps=-1"]))


def test_verl_compat_takes_a_launch_line_as_the_scripts_write_it(capsys):
    from verl.cli.main import main as verl_main
    from verl.compat.command import translate_command

    line = ["ray", "job", "submit", "--no-wait", "--working-dir", ".", "--", "python3", "-m",
            "recipe.dapo.main_dapo", "algorithm.filter_groups.enable=True", f"{ARR}.model.path=tiny"]
    module, t = translate_command(line)
    assert module == "recipe.dapo.main_dapo" and _ours(t)["algorithm.filter_groups"] == "True"
    assert translate_command(["data.train_files=x.jsonl"])[0] == "verl.trainer.main_ppo"
    assert translate_command(["torchrun", "-m", "verl.trainer.fsdp_sft_trainer", "optim.lr=1e-4"])[1].ours[0] == (
        "trainer.kind=sft")
    assert verl_main(["compat", *line]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("verl train algorithm.filter_groups=True model.path=tiny")
    assert "`python -m recipe.dapo.main_dapo`" in captured.err
    assert verl_main(["compat", "python3", "-m", "recipe.nope.main"]) == 1
    assert "not a volcengine/verl entry point" in capsys.readouterr().err


def test_the_cpu_line_replaces_the_runs_sizes_and_keeps_one_item_per_key():
    from verl.compat.command import cpu_command

    words = shlex.split(cpu_command(translate(VERL_GRPO)))
    assert words[:4] == ["verl", "train", "--nproc", "1"]
    keys = [w.partition("=")[0] for w in words[4:]]
    assert len(keys) == len(set(keys))
    items = dict(w.split("=", 1) for w in words[4:])
    assert items["model.path"] == "tiny" and items["rollout.engine"] == "hf" and items["trainer.total_steps"] == "2"
    assert items["reward.functions"] == "[{name: reward.py:compute_score}]"  # the user's own function stays
    config = load_config(None, words[4:])
    assert config.data.train_batch_size == 2 and config.devices.num_gpus_per_node is None
    sft = shlex.split(cpu_command(translate_sft(["model.partial_pretrain=Qwen/Qwen2.5-0.5B",
                                                 "trainer.total_epochs=3"])))
    sft_items = dict(w.split("=", 1) for w in sft[4:])
    assert sft_items["sft.steps"] == "2" and sft_items["sft.epochs"] == "null" and "rollout.n" not in sft_items
    assert load_config(None, sft[4:]).sft.epochs is None


def test_the_cpu_line_of_a_run_with_a_reward_model_uses_the_tiny_one():
    """verl's ppo `run_qwen2-7b_rm` scores with a reward model: the CPU line points it at the local tiny one."""
    from verl.compat.command import cpu_command

    words = shlex.split(cpu_command(translate([*VERL_GRPO, "reward_model.enable=True",
                                               "reward_model.model.path=/models/rm-7b"])))
    items = dict(w.split("=", 1) for w in words[4:])
    assert items["reward.model_path"] == "tiny" and items["model.path"] == "tiny"
    assert "reward.model_path" not in dict(w.split("=", 1) for w in shlex.split(cpu_command(translate(VERL_GRPO)))[4:])


def test_verls_reward_manager_is_where_reward_calls_run():
    assert translate(["reward_model.reward_manager=prime"]).ours == ["reward.executor=process"]
    assert translate(["reward_model.reward_manager=naive"]).ours == ["reward.executor=thread"]
    assert translate(["reward_model.reward_manager=batch"]).decide[0][1].startswith("reward.executor")


def test_ulysses_sizes_and_per_gpu_token_budgets():
    """verl's token budget is per GPU after the Ulysses split; ours counts the micro-batch before it."""
    arr = "actor_rollout_ref.actor"
    t = translate([f"{arr}.ulysses_sequence_parallel_size=4", f"{arr}.ppo_max_token_len_per_gpu=16384",
                   "critic.ppo_max_token_len_per_gpu=32768", "critic.ulysses_sequence_parallel_size=2"])
    ours = dict(item.split("=", 1) for item in t.ours)
    assert ours["actor.sequence_parallel_size"] == "4" and ours["actor.max_tokens_per_micro_batch"] == "65536"
    assert ours["critic.max_tokens_per_micro_batch"] == "65536"  # the critic's own size, 2
    assert (f"{arr}.ppo_max_token_len_per_gpu=16384", "actor.max_tokens_per_micro_batch=65536: verl's budget is "
            "per GPU after the 4-way split, ours the micro-batch's before it") in t.notes
    assert [theirs for theirs, _ in t.decide if "ulysses" in theirs] == ["critic.ulysses_sequence_parallel_size=2"]
    plain = translate([f"{arr}.ppo_max_token_len_per_gpu=16384", "critic.ulysses_sequence_parallel_size=1"])
    assert "actor.max_tokens_per_micro_batch=16384" in plain.ours and not [d for d in plain.decide if "ulysses" in d[0]]
    load_config(None, t.ours)  # every translated item is a valid setting


def test_a_value_that_is_not_a_number_is_left_to_decide_not_a_traceback():
    arr = "actor_rollout_ref.actor"
    t = translate([f"{arr}.optim.lr_warmup_steps_ratio=abc", f"{arr}.ulysses_sequence_parallel_size=two",
                   f"{arr}.ppo_max_token_len_per_gpu=100", "critic.optim.lr_warmup_steps_ratio=0.1",
                   "trainer.total_training_steps=x"])
    decided = dict(t.decide)
    assert decided[f"{arr}.optim.lr_warmup_steps_ratio=abc"].startswith("actor.warmup_steps (a count of steps")
    assert decided["critic.optim.lr_warmup_steps_ratio=0.1"].startswith("critic.warmup_steps (a count of steps")
    assert decided[f"{arr}.ppo_max_token_len_per_gpu=100"].startswith("actor.max_tokens_per_micro_batch (a "
                                                                        "micro-batch's tokens before the Ulysses split")
    assert not [o for o in t.ours if "warmup_steps=" in o or "max_tokens_per_micro_batch=" in o]
