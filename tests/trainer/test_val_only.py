"""`trainer.val_only`: validate the checkpoint `trainer.resume` finds (or the model as loaded) and stop,
changing nothing: no step, no checkpoint, no weight, no deleted metric row."""

from __future__ import annotations

import json

import pytest
import torch
from rl_support import read_metrics, rl_config

from verl.checkpoint import list_checkpoints
from verl.errors import ConfigError
from verl.trainer.checks.startup import check_startup
from verl.trainer.compose.loop import banner_lines
from verl.trainer.rl_trainer import RLTrainer

RUN = ("trainer.total_steps=3", "checkpoint.save_interval=2", "trainer.val_every=2", "trainer.val_before_train=false")


def test_val_only_validates_the_checkpoint_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    trained = RLTrainer(rl_config(run_dir, *RUN))
    trained.fit()  # validates at steps 2 and 3, keeps checkpoints of both
    at_step_2 = {k: v for k, v in trained.history[1].items() if k.startswith("val/")}
    assert trained.history[1]["step"] == 2 and at_step_2
    checkpoints = [c.path for c in list_checkpoints(run_dir)]
    rows = read_metrics(run_dir)

    step_2 = next(c.path for c in list_checkpoints(run_dir) if c.step == 2)
    only = RLTrainer(rl_config(run_dir, *RUN, "trainer.val_only=true", f"trainer.resume={step_2}"))
    history = only.fit()
    assert only.step_count == 2 and history[-1]["step"] == 2
    got = {k: v for k, v in history[-1].items() if k.startswith("val/")}
    assert got == at_step_2  # greedy validation of the step-2 weights, as during training
    assert [c.path for c in list_checkpoints(run_dir)] == checkpoints  # nothing saved, nothing pruned
    after = read_metrics(run_dir)
    assert after[: len(rows)] == rows and len(after) == len(rows) + 1  # appended, nothing truncated
    assert after[-1]["step"] == 2 and after[-1]["val/score"] == at_step_2["val/score"]


def test_val_only_without_a_checkpoint_validates_the_loaded_model(tmp_path):
    only = RLTrainer(rl_config(tmp_path / "run", "trainer.val_only=true"))
    before = {k: v.clone() for k, v in only.model.state_dict().items()}
    history = only.fit()
    assert only.step_count == 0 and [r["step"] for r in history] == [0] and "val/score" in history[0]
    assert all(torch.equal(before[k], v) for k, v in only.model.state_dict().items())
    assert not list_checkpoints(tmp_path / "run")
    lines = banner_lines(only, None, None)
    assert lines[0].endswith("validation only") and "validating the model as loaded" in lines[-1]


def test_val_only_needs_held_out_rows(tmp_path):
    from verl.trainer.offline.sft_trainer import SFTTrainer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "output": str(i + 1)}) + "\n" for i in range(8)))
    config = rl_config(tmp_path / "run", "trainer.kind=sft", "data.kind=sft", f"data.train_files=[{data}]",
                       "env.name=null", "trainer.val_only=true", reward=None)
    with pytest.raises(ConfigError, match="trainer.val_only=true validates on held-out rows.*data.val_files"):
        SFTTrainer(config).fit()


def test_a_demo_cannot_be_validation_only(tmp_path):
    config = rl_config(tmp_path / "run", "trainer.demo=arithmetic", "trainer.val_only=true")
    problems = [str(p) for p in check_startup(config, world_size=1).problems]
    assert any("trainer.val_only validates and stops, but trainer.demo=arithmetic" in p for p in problems)


def by_source(prompt, response, ground_truth, data_source=None, **metadata):
    return {"gsm8k": 1.0, "math": 0.0}.get(data_source, 0.5)


def test_validation_reports_each_data_source_when_the_rows_mix_several(tmp_path):
    """As volcengine/verl reports a validation score per data source (GSM8K and MATH test sets together)."""
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": source}
            for i, source in enumerate(["gsm8k"] * 3 + ["math"] * 2 + ["other"])]
    trainer = RLTrainer.from_pretrained("tiny", reward_fn=by_source, dataset=rows, data={"train_batch_size": 2},
                                        rollout={"n": 2, "max_new_tokens": 3},
                                        trainer={"total_steps": 1, "device": "cpu", "run_dir": str(tmp_path / "run")})
    samples = []
    metrics = trainer.evaluate(rows, prefix="val", samples=samples)
    assert metrics["val/score"] == pytest.approx((3 * 1.0 + 2 * 0.0 + 0.5) / 6) and "val/accuracy" not in metrics
    assert metrics["val/gsm8k/score"] == metrics["val/gsm8k/accuracy"] == 1.0
    assert metrics["val/math/score"] == metrics["val/math/accuracy"] == 0.0
    assert metrics["val/other/score"] == 0.5 and "val/other/accuracy" not in metrics
    assert [s["data_source"] for s in samples] == [r["data_source"] for r in rows][: len(samples)]
    one = trainer.evaluate(rows[:3], prefix="val")  # a single source: nothing repeated
    assert set(one) == {"val/score", "val/accuracy"}


def first_digit_reward(prompt, response, ground_truth, **metadata):  # about half the answers score 1
    return float(bool(response) and ord(response[0]) % 2 == 0)


def test_several_answers_per_held_out_prompt_give_the_mean_and_pass_at_n(tmp_path):
    """rollout.val_n answers per prompt: val/score is their mean, val/pass@n the share of prompts with a correct
    one; each computed here from the answers themselves (the sampler's own stream, reproduced)."""
    rows = [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i), "data_source": "a" if i < 3 else "b"}
            for i in range(5)]
    trainer = RLTrainer.from_pretrained("tiny", reward_fn=first_digit_reward, dataset=rows,
                                        data={"train_batch_size": 2},
                                        rollout={"n": 2, "max_new_tokens": 2, "val_n": 4, "val_temperature": 1.0},
                                        trainer={"total_steps": 1, "device": "cpu", "run_dir": str(tmp_path / "run")})
    seen = []
    score = trainer.env.compute_reward
    trainer.env.compute_reward = lambda chunk, responses: seen.append((chunk, responses)) or score(chunk, responses)
    metrics = trainer.evaluate(rows, prefix="val")
    ((chunk, responses),) = seen
    assert [r["prompt"] for r in chunk] == [r["prompt"] for r in rows for _ in range(4)]  # a row's 4 together
    scores = torch.tensor([first_digit_reward(r["prompt"], a, r["ground_truth"])
                           for r, a in zip(chunk, responses, strict=True)], dtype=torch.float64).view(5, 4)
    assert metrics["val/score"] == pytest.approx(float(scores.mean()))
    assert metrics["val/pass@4"] == pytest.approx(float(scores.amax(dim=1).mean()))
    assert metrics["val/a/pass@4"] == pytest.approx(float(scores[:3].amax(dim=1).mean()))
    assert metrics["val/b/score"] == pytest.approx(float(scores[3:].mean()))
    assert 0 < metrics["val/score"] < metrics["val/pass@4"]  # the answers differ: best-of-4 beats the mean

    greedy = rl_config(tmp_path / "g", "rollout.val_n=4")
    problems = [str(p) for p in check_startup(greedy, world_size=1).problems]
    assert any("rollout.val_n=4 answers per held-out prompt would all be the same greedy answer" in p for p in problems)
