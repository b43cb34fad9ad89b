import pytest
import yaml

from verl.config import RunConfig, config_to_yaml, load_config, split_legacy_flags
from verl.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_defaults_are_one_object():
    assert load_config() == RunConfig()


def test_typo_names_key_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "actor:\n  lrr: 1\n"))
    msg = str(err.value)
    assert "actor.lrr" in msg and "Did you mean 'actor.lr'" in msg and "cfg.yaml" in msg


def test_three_errors_are_listed_together(tmp_path):
    path = write(tmp_path, "actor:\n  lrr: 1\nrollout:\n  n: 0\ntrainer:\n  kind: ppo\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "3 problem(s)" in msg
    for fragment in ("actor.lrr", "rollout.n", "trainer.kind"):
        assert fragment in msg


def test_unknown_section_suggests(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'rollout'"):
        load_config(overrides=["rollot.n=2"])


def test_overrides_beat_yaml_and_parse_types(tmp_path):
    path = write(tmp_path, "actor:\n  lr: 1.0e-5\nrollout:\n  n: 2\n")
    cfg = load_config(path, ["actor.lr=1e-6", "rollout.top_k=5", "data.train_files=a.jsonl,b.jsonl"])
    assert cfg.actor.lr == 1e-6 and cfg.rollout.n == 2 and cfg.rollout.top_k == 5
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]


@pytest.mark.parametrize("text,value", [("True", True), ("False", False), ("true", True),
                                        ("false", False), ("1", True), ("0", False)])
def test_booleans_accept_common_spellings(text, value):
    assert load_config(overrides=[f"checkpoint.async_save={text}"]).checkpoint.async_save is value


def test_legacy_flags_map_to_keys():
    argv = ["--actor_device_ids", "0,1", "--critic_device_ids=2,3", "--ref_device_id", "0",
            "--reward_device_id", "3", "--num_gpus_per_node", "4", "--save_interval", "5",
            "--async_save", "False", "--save_total_limit", "2"]
    cfg = load_config(legacy_argv=argv)
    assert cfg.devices.actor == [0, 1] and cfg.devices.critic == [2, 3]
    assert cfg.devices.ref == [0] and cfg.devices.reward == [3]
    assert cfg.devices.num_gpus_per_node == 4
    assert cfg.checkpoint.save_interval == 5 and cfg.checkpoint.async_save is False
    assert cfg.checkpoint.save_total_limit == 2


def test_dotted_override_beats_legacy_flag():
    cfg = load_config(overrides=["checkpoint.save_interval=7"], legacy_argv=["--save_interval", "5"])
    assert cfg.checkpoint.save_interval == 7


def test_legacy_flag_without_value_and_unknown_flag():
    with pytest.raises(ConfigError, match="--ref_device_id needs a value"):
        split_legacy_flags(["--ref_device_id"])
    with pytest.raises(ConfigError, match="unknown flag"):
        load_config(legacy_argv=["--actr_device_ids", "0"])


def test_malformed_override_reported():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(overrides=["actor..lr=1"])


def test_bad_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"cfg.yaml:3: not valid YAML"):
        load_config(write(tmp_path, "actor:\n  lr: 1\n bad: [\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_yaml_round_trip(tmp_path):
    cfg = load_config(overrides=["actor.lr=3e-6", "devices.actor=[0,1]"])
    again = load_config(write(tmp_path, config_to_yaml(cfg)))
    assert again.model_dump() == cfg.model_dump()
    assert yaml.safe_load(config_to_yaml(cfg))["actor"]["lr"] == 3e-6


def test_yaml_follows_a_config_changed_in_place():
    """config_to_yaml keeps recent results (every RL step snapshots the config): a config changed in place, or
    another config, gets its own text."""
    cfg = load_config()
    first = config_to_yaml(cfg)
    assert config_to_yaml(cfg) == first
    cfg.actor.lr = 0.125
    assert yaml.safe_load(config_to_yaml(cfg))["actor"]["lr"] == 0.125
    assert config_to_yaml(load_config()) == first


def test_derived_role_needs():
    assert load_config(overrides=["algorithm.adv_estimator=gae"]).needs_critic
    assert not load_config().needs_ref
    assert load_config(overrides=["actor.kl_loss_coef=0.01"]).needs_ref
    assert load_config(overrides=["algorithm.kl_in_reward=true"]).needs_ref


# --- problems that came from the command line say so --------------------------------------------------

def test_override_problems_name_the_command_line(tmp_path):
    from verl.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text("rollout: {n: 0}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["actor.lr=abc", "rollout.nn=3", ".x=1"])
    text = str(err.value)
    assert text.startswith(f"{path} + command line has 4 problem(s):")
    assert "  - rollout.n: Input should be greater than 0 (got 0)\n" in text  # from the file: no origin
    assert "actor.lr: Input should be a valid number" in text and "(from the command line: actor.lr=abc)" in text
    assert "rollout.nn: unknown key (from the command line: rollout.nn=3). Did you mean 'rollout.n'?" in text
    assert "override '.x=1': expected KEY=VALUE" in text and text.rstrip().endswith("(from the command line)")


def test_legacy_flag_problems_name_the_flag():
    from verl.config import load_config

    with pytest.raises(ConfigError, match=r"devices\.actor\.1: .*\(from the command line: --actor_device_ids 0,x\)"):
        load_config(None, [], legacy_argv=["--actor_device_ids", "0,x"])
    with pytest.raises(ConfigError, match=r"unknown flag\(s\) on the command line: --foo"):
        load_config(None, [], legacy_argv=["--foo"])


def test_file_only_problems_do_not_mention_the_command_line(tmp_path):
    from verl.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text("rollout: {n: 0}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(path, [])
    assert str(err.value).startswith(f"{path} has 1 problem(s)") and "command line" not in str(err.value)



def test_reward_functions_may_be_given_by_name_alone():
    """`reward.functions=[numeric_match, reward.py:fn]` on a command line is short for `{name: ...}` entries."""
    config = load_config(None, ["reward.functions=[numeric_match, {name: r.py:fn, weight: 2}]"])
    assert config.reward.functions == [{"name": "numeric_match"}, {"name": "r.py:fn", "weight": 2}]
    assert load_config(None, ["reward.functions=r.py:fn"]).reward.functions == [{"name": "r.py:fn"}]
