"""The start-up check pass is a table (`CHECKS`: name, trainer kinds, function) over one `CheckPass`, and the
policy's facts (config, meta-device model) are read once per pass, not once per check."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from verl.config import load_config
from verl.trainer.build.models import resolve_model_path
from verl.trainer.checks import startup
from verl.trainer.checks.startup import ALL_KINDS, CHECKS, check_startup


def test_every_check_has_one_name_and_known_kinds():
    names = [c.name for c in CHECKS]
    assert len(names) == len(set(names)) and names[0] == "device mapping"
    assert all(c.kinds and c.kinds <= ALL_KINDS for c in CHECKS)
    assert [c.name for c in CHECKS if c.kinds == {"rl"}][:2] == ["rollout engine", "agent"]


def test_the_policy_config_is_read_once_and_its_meta_model_built_once(tmp_path, monkeypatch):
    tiny = resolve_model_path("tiny")
    reads, builds = [], []
    read, build = AutoConfig.from_pretrained, AutoModelForCausalLM.from_config
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda path, *a, **k: (reads.append(str(path)), read(
        path, *a, **k))[1])
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", lambda cfg, *a, **k: (builds.append(1), build(
        cfg, *a, **k))[1])
    config = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}", "trainer.device=cpu",
                                "model.lora.rank=4"])
    report = check_startup(config, world_size=1, model_path=tiny, device_type="cpu")
    assert not report.problems, report.problems
    assert reads.count(tiny) == 1 and len(builds) == 1, (reads, builds)
    assert report.parameters is not None and report.parameters.trainable < report.parameters.total  # LoRA counted


def test_a_check_that_raises_is_a_problem_and_the_rest_still_run(tmp_path, monkeypatch):
    from verl.errors import ConfigError

    def broken(engine, device_type):
        raise ConfigError("rollout engine exploded")

    monkeypatch.setattr(startup, "check_rollout_engine", broken)
    config = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}", "trainer.device=cpu", "rollout.val_n=4"])
    problems = [str(p) for p in check_startup(config, world_size=1, model_path=None, device_type="cpu").problems]
    assert "rollout engine exploded" in problems[0]
    assert any("rollout.val_n=4 answers per held-out prompt" in p for p in problems[1:]), problems
