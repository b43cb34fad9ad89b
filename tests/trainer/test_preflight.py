"""`verl check` and the trainer's start-up run one pass: the same configs fail with the same problems."""

from __future__ import annotations

import json

import pytest
from rl_support import base_overrides

from verl.cli.check_cmd import collect
from verl.cli.main import main
from verl.config import load_config
from verl.errors import ConfigError, VerlError
from verl.trainer.checks import preflight as preflight_module
from verl.trainer.checks.startup import plans_for
from verl.trainer.entry import build_trainer
from verl.trainer.rl_trainer import RLTrainer


def _long_prompt_file(tmp_path):
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "what is 1 + 1?", "ground_truth": "2"},
            {"prompt": "add these numbers: " + " + ".join(str(i) for i in range(60)), "ground_truth": "1770"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _data_overrides(tmp_path, *files):
    return ["env.name=null", "env.kwargs={}", f"data.train_files=[{','.join(str(f) for f in files)}]",
            "reward.functions=[{name: numeric_match}]"]


def _rows_file(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _few_rows(tmp_path):
    return _data_overrides(tmp_path, _rows_file(tmp_path, "few.jsonl",
                                                [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(3)]))


def _no_ground_truth(tmp_path):
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(6)]
    rows[2].pop("ground_truth")
    rows[4]["ground_truth"] = None
    return _data_overrides(tmp_path, _rows_file(tmp_path, "nogt.jsonl", rows))


def _other_tokenizer(tmp_path):
    from verl.trainer.build.models import resolve_model_path

    return [f"model.tokenizer_path={resolve_model_path('tiny:llama')}"]


BAD = {
    "fp16 on cpu": lambda tmp: ["model.dtype=fp16"],
    "flash attention on cpu": lambda tmp: ["model.attn_implementation=flash_attention_2"],
    "fewer rows than a batch": _few_rows,
    "rows lack the ground truth": _no_ground_truth,
    "tokenizer vocabulary differs": _other_tokenizer,
    "batch arithmetic": lambda tmp: ["actor.mini_batch_size=8"],
    "device mapping": lambda tmp: ["devices.actor=[0,1,2]"],
    "missing data file": lambda tmp: _data_overrides(tmp, tmp / "missing.jsonl"),
    "prompt too long": lambda tmp: [*_data_overrides(tmp, _long_prompt_file(tmp)), "data.max_prompt_length=16",
                                    "data.truncation=error"],
    "unknown reward function": lambda tmp: ["reward.functions=[{name: numeric_mach}]"],
    "sft data file missing": lambda tmp: ["trainer.kind=sft", *_data_overrides(tmp, tmp / "missing.jsonl")],
    "dpo bad dtype": lambda tmp: ["trainer.kind=dpo", "model.dtype=float8",
                                  *_data_overrides(tmp, tmp / "missing.jsonl")],
    "sft steps and epochs": lambda tmp: ["trainer.kind=sft", "sft.steps=3", "sft.epochs=1"],
    "dpo label smoothing": lambda tmp: ["trainer.kind=dpo", "dpo.label_smoothing=0.1", "dpo.loss_type=ipo"],
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
    assert problems("fp16 on cpu") == [
        "[start-up] model.dtype=fp16 was requested for a model on CPU, where fp16 matmuls are unsupported or very "
        "slow. Fix: use dtype 'fp32' (or 'bf16') on CPU, or run on a CUDA GPU."]
    flash = problems("flash attention on cpu")
    assert len(flash) == 1 and flash[0].startswith("[model] model.attn_implementation=flash_attention_2 was requested")
    assert 'Fix: use model.attn_implementation="sdpa"' in flash[0]
    several = problems("several at once")
    assert [m.split("]")[0] for m in several] == ["[start-up", "[data", "[rewards"]
    assert problems("fewer rows than a batch") == [
        f"[data] data.train_batch_size=4 prompts per step, but {tmp_path / 'few.jsonl'} has only 3 training "
        "prompts after the data checks, so not even one batch of distinct prompts exists. Fix: set "
        "data.train_batch_size=3 or lower, or add data."]
    nogt = problems("rows lack the ground truth")
    assert nogt == [
        f"[environment] train data: 2 row(s) have no ground truth, but reward function(s) numeric_match need one "
        f"to score them: {tmp_path / 'nogt.jsonl'}:3, {tmp_path / 'nogt.jsonl'}:5. Fix: add the answer to those "
        "rows (field 'ground_truth', or map your field with data.fields.ground_truth=KEY), drop the rows, or use "
        "a reward function that needs no ground truth."]
    mismatch = problems("tokenizer vocabulary differs")
    assert len(mismatch) == 1 and mismatch[0].startswith("[model] model.tokenizer_path=")
    assert "has a different vocabulary from the tokenizer of model.path=tiny" in mismatch[0]
    assert "Fix: remove model.tokenizer_path" in mismatch[0] and "model.allow_tokenizer_mismatch=true" in mismatch[0]


def test_the_trainer_loads_the_model_once_and_keeps_the_checked_rows(tmp_path, monkeypatch):
    """The check pass reads no weights; the composition loads the policy once, with the pass's tokenizer,
    and trains on the rows and environment the pass built (no second read of the files)."""
    from verl.trainer.compose import components

    calls, reads = [], []
    real = components.load_policy_with_report
    real_split = preflight_module.split_train_val

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    def counting_split(*args, **kwargs):
        reads.append(args)
        return real_split(*args, **kwargs)

    monkeypatch.setattr(components, "load_policy_with_report", counting)
    monkeypatch.setattr(preflight_module, "split_train_val", counting_split)
    path = _long_prompt_file(tmp_path)
    config = load_config(overrides=[*base_overrides(tmp_path / "run"), *_data_overrides(tmp_path, path),
                                    "data.max_prompt_length=16", "data.truncation=drop",
                                    "data.train_batch_size=1"])  # one prompt is left: one full batch
    trainer = RLTrainer(config)
    assert len(calls) == 1 and calls[0].get("weights", True) is True  # the real load (the pass built on meta)
    assert calls[0]["tokenizer"] is trainer.checks.tokenizer is trainer.tokenizer  # loaded once, by the pass
    assert len(reads) == 1 and trainer.env is trainer.checks.env  # the rows were read once
    assert not hasattr(trainer.checks, "model")  # the pass holds no model
    assert len(trainer.env) == 1  # the long prompt was dropped with the trainer's tokenizer and limit


def test_verl_check_reads_no_weights(tmp_path, monkeypatch):
    """`verl check` builds the policy on the meta device: every model/tokenizer check, no weight read."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("verl check read weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    pf = collect(load_config(overrides=base_overrides(tmp_path / "run")), nproc=1)
    assert pf.messages == []
    assert pf.model_report is not None and pf.model_report.device == "meta"
    assert pf.model_report.num_parameters > 0 and pf.model_report.ok


def test_offline_batch_sizes_are_checked_over_the_ranks():
    config = load_config(overrides=["trainer.kind=sft", "sft.batch_size=6", "data.train_batch_size=8"])
    with pytest.raises(ConfigError, match=r"sft.batch_size=6 cannot be split evenly over 4 data-parallel ranks"):
        plans_for(config, 4)
    assert plans_for(config, 3) == {}
    with pytest.raises(ConfigError, match=r"data.train_batch_size=8 cannot be split evenly over 3"):
        plans_for(config, 3, kind="dpo")


def test_allowed_tokenizer_mismatch_is_a_warning_and_the_check_passes(tmp_path, capsys):
    overrides = [*base_overrides(tmp_path / "run"), *_other_tokenizer(tmp_path), "model.allow_tokenizer_mismatch=true"]
    pf = collect(load_config(overrides=overrides), nproc=1)
    assert pf.messages == []
    assert len(pf.warnings) == 1 and "allowed by model.allow_tokenizer_mismatch=true" in str(pf.warnings[0])
    assert main(["check", *overrides, "--nproc", "1"]) == 0
    out = capsys.readouterr().out
    assert "warning: model.tokenizer_path=" in out and "all checks passed" in out


def test_same_tokenizer_folder_is_not_a_mismatch(tmp_path):
    from verl.trainer.build.models import resolve_model_path

    overrides = [*base_overrides(tmp_path / "run"), f"model.tokenizer_path={resolve_model_path('tiny')}"]
    pf = collect(load_config(overrides=overrides), nproc=1)
    assert pf.messages == [] and pf.warnings == []


def test_latest_naming_a_broken_folder_does_not_stop_the_run(tmp_path):
    """One rule for damaged checkpoints (issue 45): the resume skips them with one message
    (tests/checkpoint/test_disk_full.py), so the start-up checks refuse nothing here."""
    root = tmp_path / "run" / "checkpoints"
    (root / "step_3").mkdir(parents=True)
    (root / "latest").write_text("step_3\n", encoding="utf-8")
    overrides = [*base_overrides(tmp_path / "run"), "trainer.resume=auto"]
    assert collect(load_config(overrides=overrides), nproc=1).messages == []


def test_offline_batch_larger_than_the_data_is_a_warning(tmp_path):
    rows = [{"input": f"{i}+1=", "output": str(i + 1)} for i in range(3)]
    path = _rows_file(tmp_path, "sft.jsonl", rows)
    overrides = [*base_overrides(tmp_path / "run"), "trainer.kind=sft", "env.name=null", "env.kwargs={}",
                 "data.kind=sft", f"data.train_files=[{path}]", "sft.batch_size=4"]
    pf = collect(load_config(overrides=overrides), nproc=1)
    assert pf.messages == []
    assert [str(w) for w in pf.warnings] == [
        f"[data] sft.batch_size=4 examples per step, but {path} has only 3 training examples after the data "
        "checks, so each step repeats rows. Fix: set sft.batch_size=3 or lower, or add data."]


def test_the_trainer_shows_the_start_up_warnings(tmp_path):
    overrides = [*base_overrides(tmp_path / "run"), *_other_tokenizer(tmp_path), "model.allow_tokenizer_mismatch=true"]
    with pytest.warns(UserWarning, match=r"different vocabulary .* allowed by model.allow_tokenizer_mismatch=true"):
        RLTrainer(load_config(overrides=overrides))
