"""`verl check` and the trainer's start-up run one pass: the same configs fail with the same problems."""

from __future__ import annotations

import json

import pytest
from rl_support import base_overrides

from verl.cli.check_cmd import collect
from verl.cli.main import main
from verl.config import load_config
from verl.errors import ConfigError, VerlError
from verl.trainer import preflight as preflight_module
from verl.trainer.entry import build_trainer
from verl.trainer.rl_trainer import RLTrainer
from verl.trainer.startup import plans_for


def _long_prompt_file(tmp_path):
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "what is 1 + 1?", "ground_truth": "2"},
            {"prompt": "add these numbers: " + " + ".join(str(i) for i in range(60)), "ground_truth": "1770"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _data_overrides(tmp_path, *files):
    return ["env.name=null", "env.kwargs={}", f"data.train_files=[{','.join(str(f) for f in files)}]",
            "reward.functions=[{name: numeric_match}]"]


BAD = {
    "batch arithmetic": lambda tmp: ["actor.mini_batch_size=8"],
    "device mapping": lambda tmp: ["devices.actor=[0,1,2]"],
    "missing data file": lambda tmp: _data_overrides(tmp, tmp / "missing.jsonl"),
    "prompt too long": lambda tmp: [*_data_overrides(tmp, _long_prompt_file(tmp)), "data.max_prompt_length=16",
                                    "data.truncation=error"],
    "unknown reward function": lambda tmp: ["reward.functions=[{name: numeric_mach}]"],
    "sft data file missing": lambda tmp: ["trainer.kind=sft", *_data_overrides(tmp, tmp / "missing.jsonl")],
    "dpo bad dtype": lambda tmp: ["trainer.kind=dpo", "model.dtype=float8",
                                  *_data_overrides(tmp, tmp / "missing.jsonl")],
    "several at once": lambda tmp: ["actor.mini_batch_size=8", *_data_overrides(tmp, tmp / "missing.jsonl"),
                                    "reward.functions=[{name: numeric_mach}]"],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_check_and_trainer_report_the_same_problems(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    overrides = [*base_overrides(tmp_path / "run"), *BAD[case](tmp_path)]
    config = load_config(overrides=overrides)
    checked = collect(config, nproc=1).messages
    assert checked, f"{case}: verl check found nothing"
    with pytest.raises(VerlError) as err:
        build_trainer(config)
    assert err.value.problems == checked
    for message in checked:
        assert message.split("] ", 1)[1] in str(err.value)
    # and the command prints each of them
    assert main(["check", *overrides, "--nproc", "1"]) == 1
    out = capsys.readouterr().out
    for message in checked:
        assert message.split("] ", 1)[1].splitlines()[0] in out


def test_the_problems_name_what_went_wrong(tmp_path):
    def problems(case):
        return collect(load_config(overrides=[*base_overrides(tmp_path / "run"), *BAD[case](tmp_path)]),
                       nproc=1).messages

    assert any("actor.mini_batch_size=8" in m for m in problems("batch arithmetic"))
    assert any("outside the world of 1" in m for m in problems("device mapping"))
    assert any(m.startswith("[data] train data:") and "missing.jsonl" in m for m in problems("missing data file"))
    long = problems("prompt too long")
    assert len(long) == 1 and long[0].startswith("[data] train data:") and "max_prompt_length" in long[0]
    assert any(m.startswith("[environment]") and "numeric_mach" in m for m in problems("unknown reward function"))
    several = problems("several at once")
    assert [m.split("]")[0] for m in several] == ["[start-up", "[data", "[rewards"]


def test_the_trainer_loads_the_model_once_and_keeps_the_checked_rows(tmp_path, monkeypatch):
    calls = []
    real = preflight_module.load_policy_with_report

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(preflight_module, "load_policy_with_report", counting)
    path = _long_prompt_file(tmp_path)
    config = load_config(overrides=[*base_overrides(tmp_path / "run"), *_data_overrides(tmp_path, path),
                                    "data.max_prompt_length=16", "data.truncation=drop"])
    loaded = []
    real_take = preflight_module.Preflight.take

    def recording_take(self, name):
        value = real_take(self, name)
        loaded.append((name, value))
        return value

    monkeypatch.setattr(preflight_module.Preflight, "take", recording_take)
    trainer = RLTrainer(config)
    assert len(calls) == 1
    taken = dict(loaded)
    assert taken["env"] is trainer.env and taken["model"] is trainer.model
    assert trainer.preflight.model is None and trainer.preflight.env is None  # handed over, not kept twice
    assert len(trainer.env) == 1  # the long prompt was dropped with the trainer's tokenizer and limit


def test_offline_batch_sizes_are_checked_over_the_ranks():
    config = load_config(overrides=["trainer.kind=sft", "sft.batch_size=6", "data.train_batch_size=8"])
    with pytest.raises(ConfigError, match=r"sft.batch_size=6 cannot be split evenly over 4 data-parallel ranks"):
        plans_for(config, 4)
    assert plans_for(config, 3) == {}
    with pytest.raises(ConfigError, match=r"data.train_batch_size=8 cannot be split evenly over 3"):
        plans_for(config, 3, kind="dpo")
