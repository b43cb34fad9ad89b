"""A volcengine/verl user's habits: its names for estimators and KL types work, its config keys are answered
with ours, and its data.max_response_length (the rollout length there) is not silently ignored in RL."""

from __future__ import annotations

import pytest
import yaml

from verl.compat.keys import VERL_KEYS, VERL_SFT_KEYS
from verl.config import config_to_yaml, load_config
from verl.config.schema import RunConfig
from verl.errors import ConfigError
from verl.trainer.checks.startup import check_response_length


def _our_keys() -> set[str]:
    keys = set()

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation, f"{prefix}{name}.")
            else:
                keys.add(prefix + name)

    walk(RunConfig, "")
    return keys


@pytest.mark.parametrize("table", [VERL_KEYS, VERL_SFT_KEYS], ids=["ppo", "sft"])
def test_every_verl_key_points_at_a_key_of_ours_and_is_not_one(table):
    ours = _our_keys()
    for theirs, hint in table.items():
        # else the hint could never be shown (the SFT trainer's data.train_batch_size is ours for RL prompts)
        assert theirs not in ours or theirs == "data.train_batch_size", theirs
        if hint.startswith("verl train"):
            continue
        named = hint.split(" (")[0].split(" and ")
        assert all(key in ours for key in named), (theirs, hint)


@pytest.mark.parametrize("override,ours", [
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor.lr"),
    ("actor_rollout_ref.rollout.response_length=512", "rollout.max_new_tokens"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor.micro_batch_size"),
    ("critic.optim.lr=1e-5", "critic.lr"),
    ("trainer.save_freq=10", "checkpoint.save_interval"),
    ("algorithm.kl_ctrl.kl_coef=0.01", "algorithm.kl_coef"),
    ("optim.lr=1e-5", "sft.lr"),  # verl's SFT trainer
    ("model.partial_pretrain=Qwen/Qwen2.5-0.5B", "model.path"),
])
def test_a_verl_key_on_the_command_line_is_answered_with_ours(override, ours):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    theirs = override.split("=")[0]
    assert f"volcengine/verl's; here: {theirs} -> {ours}" in str(info.value)


def test_a_verl_yaml_section_lists_each_of_its_keys_with_ours(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump({"actor_rollout_ref": {
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "hybrid_engine": True,
        "actor": {"optim": {"lr": 1e-6}, "use_kl_loss": True, "kl_loss_type": "low_var_kl"}}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "actor_rollout_ref: unknown key" in text and "Those are volcengine/verl's" in text
    for theirs, ours in (("model.path", "model.path"), ("actor.optim.lr", "actor.lr"),
                         ("actor.use_kl_loss", "actor.kl_loss_coef (a value > 0 turns the KL loss on)")):
        assert f"actor_rollout_ref.{theirs} -> {ours}" in text
    assert "hybrid_engine" not in text  # a verl key with no counterpart is not invented one


def test_a_verl_section_with_no_known_key_still_says_whose_it_is():
    with pytest.raises(ConfigError, match="actor_rollout_ref is volcengine/verl's section") as info:
        load_config(overrides=["actor_rollout_ref.hybrid_engine=true"])
    assert "(from the command line: actor_rollout_ref.hybrid_engine=true)" in str(info.value)


def test_a_misspelling_of_ours_still_gets_did_you_mean():
    with pytest.raises(ConfigError, match="Did you mean 'trainer.total_steps'"):
        load_config(overrides=["trainer.total_step=3"])


@pytest.mark.parametrize("overrides,refused", [
    (["data.max_response_length=1024"], True),                                  # verl's meaning: refused
    (["data.max_response_length=64", "rollout.max_new_tokens=64"], False),      # consistent
    ([], False),                                                                # the default
    (["data.max_response_length=1024", "trainer.kind=sft"], False),             # SFT's own key
])
def test_rl_refuses_a_data_max_response_length_it_would_ignore(overrides, refused):
    config = load_config(overrides=overrides)
    problems = check_response_length(config, config.trainer.kind)
    assert bool(problems) == refused
    if refused:
        text = str(problems[0])
        assert "data.max_response_length=1024 does nothing in an RL run" in text
        assert "Fix: set rollout.max_new_tokens=1024" in text


@pytest.mark.parametrize("key,theirs,ours", [
    ("algorithm.adv_estimator", "reinforce_plus_plus", "reinforce_pp"),
    ("algorithm.adv_estimator", "reinforce_plus_plus_baseline", "reinforce_pp_baseline"),
    ("actor.kl_loss_type", "low_var_kl", "k3"), ("actor.kl_loss_type", "mse", "k2"),
    ("algorithm.kl_type", "kl", "k1"), ("algorithm.kl_type", "abs", "abs"),
])
def test_volcengine_verl_names_are_accepted_as_ours(key, theirs, ours):
    section, name = key.split(".")
    config = load_config(overrides=[f"{key}={theirs}"])
    assert getattr(getattr(config, section), name) == ours
    yaml_text = config_to_yaml(config)
    assert f"{name}: {ours}" in yaml_text  # saved (and so resumed) under our name


def test_home_relative_paths_are_expanded_as_a_shell_would(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(overrides=["model.path=~/models/qwen", "data.train_files=~/data/train.parquet,rel.jsonl",
                                    "trainer.run_dir=~/runs/a", "critic.path=~/critic", "model.tokenizer_path=org/tok"])
    assert config.model.path == str(tmp_path / "models" / "qwen")
    assert config.data.train_files == [str(tmp_path / "data" / "train.parquet"), "rel.jsonl"]
    assert config.trainer.run_dir == str(tmp_path / "runs" / "a") and config.critic.path == str(tmp_path / "critic")
    assert config.model.tokenizer_path == "org/tok" and config.trainer.resume == "auto"  # ids and words untouched


def test_the_migration_page_table_agrees_with_the_key_table():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "migrating.md").read_text()
    section = page.split("## Config (volcengine/verl)")[1].split("\n## ")[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]  # the key table
    assert len(rows) >= 15
    for theirs, ours in ((a.strip().strip("`"), b.strip().strip("`")) for a, b in rows):
        assert theirs in VERL_KEYS and VERL_KEYS[theirs].split(" (")[0] == ours, theirs
    assert f"({len(VERL_KEYS)} keys)" in page
