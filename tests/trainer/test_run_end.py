"""How a run ends: an error that ends it saves the last completed step when the weights are as that step left
them (issue 45 item 2), and every run ends with a summary and a plot (item 8)."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from rl_support import HERE, rl_config

from verl.checkpoint import list_checkpoints
from verl.errors import VerlError
from verl.trainer.rl_trainer import RLTrainer

FLAKY = {"name": f"{HERE / 'run_end_support.py'}:flaky_reward"}
SMALL = ("rollout.max_new_tokens=2", "env.kwargs.num_val=4")


def steps(run_dir: Path) -> list[int]:
    return [c.step for c in list_checkpoints(run_dir, verify_files=False)]


def fail_reward_at(trainer: RLTrainer, step: int, monkeypatch) -> RLTrainer:
    """The reward function raises from the start of `step` (1-based) on."""
    monkeypatch.delenv("VERL_TEST_REWARD_RAISE", raising=False)
    original = trainer.step

    def step_fn():
        if trainer.step_count + 1 == step:
            monkeypatch.setenv("VERL_TEST_REWARD_RAISE", "1")
        return original()

    trainer.step = step_fn
    return trainer


def test_a_reward_error_saves_the_last_completed_step(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, *SMALL, "trainer.total_steps=5", "checkpoint.save_interval=5", reward=FLAKY)
    trainer = fail_reward_at(RLTrainer(config), 3, monkeypatch)
    with pytest.raises(VerlError) as info:
        trainer.fit()
    message = str(info.value)
    assert "the reward service is down" in message  # the error itself, then what was saved
    assert "Step 3/5 failed before its update; saved step 2; resume with the same command" in message
    assert steps(run_dir) == [2]
    # the saved state is the one step 2 left: a resume runs step 3 as a run that never failed does
    monkeypatch.delenv("VERL_TEST_REWARD_RAISE")
    resumed = RLTrainer(rl_config(run_dir, *SMALL, "trainer.total_steps=3", "checkpoint.save_interval=5",
                                  "trainer.resume=auto", reward=FLAKY))
    resumed.fit()
    straight = RLTrainer(rl_config(tmp_path / "straight", *SMALL, "trainer.total_steps=3", reward=FLAKY))
    straight.fit()
    assert [row["step"] for row in resumed.history if "reward/mean" in row] == [1, 2, 3]
    same = ("reward/mean", "actor/pg_loss", "actor/grad_norm")
    assert [{k: row[k] for k in same} for row in resumed.history if "reward/mean" in row] == [
        {k: row[k] for k in same} for row in straight.history if "reward/mean" in row]
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_an_error_in_the_update_saves_nothing_and_names_the_resume_step(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # an entropy bonus: every step has a gradient (a step whose groups all tie has none and skips its optimizer)
    config = rl_config(run_dir, *SMALL, "trainer.total_steps=5", "checkpoint.save_interval=2",
                       "actor.entropy_coef=0.01")
    trainer = RLTrainer(config)

    def broken(optimizer, args, kwargs):  # the optimizer step of step 3 raises halfway through
        if trainer.step_count == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    trainer.optimizer.register_step_post_hook(broken)
    with pytest.raises(RuntimeError) as info:
        trainer.fit()
    assert steps(run_dir) == [2]  # save_interval's, nothing after it
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "step 3/5 failed after its update had changed the weights, so it was not saved" in notes
    assert f"a resume starts from step_2 ({run_dir / 'checkpoints' / 'step_2'})" in notes


def test_an_error_before_any_checkpoint_says_a_rerun_starts_from_scratch(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, *SMALL, "trainer.total_steps=3", "checkpoint.save_interval=0", reward=FLAKY)
    trainer = fail_reward_at(RLTrainer(config), 1, monkeypatch)
    with pytest.raises(VerlError, match="Step 1/3 failed; no checkpoint was saved, so a rerun starts from scratch"):
        trainer.fit()
    assert steps(run_dir) == []


def test_a_run_ends_with_a_summary_and_a_plot(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, *SMALL, "trainer.total_steps=2", "trainer.val_every=1",
                       "logging.backends=[console,jsonl]", "checkpoint.keep_best=val/score")
    RLTrainer(config).fit()
    out = capsys.readouterr().out
    summary = out[out.index("run summary: rl, step 2/2, wall time "):]
    assert "  best validation: val/score=" in summary and "(checkpoint.keep_best, max)" in summary
    assert "  last validation (step 2): " in summary and "val/score=" in summary
    assert f"  last checkpoint: {run_dir / 'checkpoints' / 'step_2'}" in summary
    assert f"  metrics: {run_dir / 'metrics.jsonl'}" in summary
    assert f"  samples: {run_dir / 'samples.jsonl'}" in summary
    assert f"  next: verl eval {run_dir}   verl view {run_dir}   verl plot {run_dir}" in summary
    assert (run_dir / "metrics.svg").is_file()
    if find_spec("matplotlib") is None:
        assert "no PNG: matplotlib is not installed" in summary
    else:
        assert (run_dir / "metrics.png").is_file() and f"plot: {run_dir / 'metrics.png'}" in summary
    step_lines = [line for line in out.splitlines() if line.startswith("step 1/2")]
    assert step_lines and step_lines[0].split("eta")[1].split()[1].startswith("val/score=")  # keep_best first


def test_the_plot_png_is_written_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    from verl.tracking.summary import write_plot

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "val/loss": 2.0}\n{"step": 2, "val/loss": 1.5}\n')
    assert write_plot(tmp_path) == [f"plot: {tmp_path / 'metrics.png'} and {tmp_path / 'metrics.svg'}"]
    assert (tmp_path / "metrics.png").stat().st_size > 0


def test_the_best_validation_without_keep_best():
    from verl.tracking.summary import best_validation, last_validation

    history = [{"step": 1, "val/loss": 2.0}, {"step": 2, "loss": 1.0}, {"step": 3, "val/loss": 1.5},
               {"step": 4, "val/loss": 1.5}]
    assert best_validation(history) == ("val/loss", 1.5, 3)  # lower is better for a loss; the earliest tie
    assert best_validation([{"step": 1, "val/score": 0.2}, {"step": 2, "val/score": 0.5}]) == ("val/score", 0.5, 2)
    assert last_validation(history) == (4, {"val/loss": 1.5})
    assert best_validation([{"step": 1, "loss": 1.0}]) is None


def test_an_sft_run_shows_val_loss_on_the_console_and_in_its_summary(tmp_path, capsys):
    from verl.config.loader import build_config
    from verl.trainer.entry import build_trainer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {a}+{b}?", "output": f" {a + b}."}) + "\n"
                            for a in range(4) for b in range(3)))
    config = build_config({
        "model": {"path": "tiny", "dtype": "float32"},
        "trainer": {"device": "cpu", "kind": "sft", "total_steps": 2, "val_every": 1, "run_dir": str(tmp_path / "run")},
        "logging": {"backends": ["console", "jsonl"]}, "sft": {"batch_size": 4, "lr": 1e-3},
        "data": {"train_files": [str(data)], "val_size": 3, "max_prompt_length": 32, "max_response_length": 32}})
    build_trainer(config).fit()
    out = capsys.readouterr().out
    assert [line.split("eta")[0].strip() for line in out.splitlines() if "val/loss=" in line
            and line.startswith("step ")] == ["step 0/2", "step 1/2", "step 2/2"]
    assert "run summary: sft, step 2/2" in out and "  best validation: val/loss=" in out
    assert "  last validation (step 2): val/loss=" in out
