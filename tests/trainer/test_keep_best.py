"""`checkpoint.keep_best`: the checkpoint of the best validation survives the save_total_limit rotation, is
named in `verl ckpt list`, survives a resume, and a checkpoint is saved off save_interval only to keep a new
best. The validations are scripted (a value per step) so the best step is known."""

from __future__ import annotations

import json

import pytest
from rl_support import read_metrics, rl_config

from verl.checkpoint import list_checkpoints
from verl.checkpoint.best import BestRecord, improves, read_best
from verl.cli.main import main
from verl.errors import ConfigError
from verl.trainer.checks.startup import check_startup
from verl.trainer.rl_trainer import RLTrainer

KEEP = ("trainer.val_every=1", "checkpoint.save_interval=0", "checkpoint.save_total_limit=1",
        "checkpoint.keep_best=val/score", "rollout.max_new_tokens=2")


def scripted(trainer: RLTrainer, values: dict[int, float]) -> RLTrainer:
    trainer.validate = lambda: {"val/score": values[trainer.step_count], "val/pass@1": 0.0}
    return trainer


def steps(run_dir) -> list[int]:
    return [c.step for c in list_checkpoints(run_dir, verify_files=False)]


def test_the_best_checkpoint_survives_rotation_and_a_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    values = {1: 0.2, 2: 0.9, 3: 0.1, 4: 0.5, 5: 0.3, 6: 0.85, 7: 0.1}
    scripted(RLTrainer(rl_config(run_dir, *KEEP, "trainer.total_steps=5")), values).fit()
    # saved: step 1 (a first best), step 2 (a better one), step 5 (the last); steps 3 and 4 beat nothing and
    # fall off save_interval; the rotation (limit 1) dropped step 1 but keeps the best apart from it
    assert steps(run_dir) == [2, 5]
    assert read_best(run_dir / "checkpoints") == BestRecord(2, "val/score", 0.9, "max")
    infos = {c.step: c for c in list_checkpoints(run_dir, verify_files=False)}
    assert infos[2].best is not None and infos[5].best is None and infos[5].is_latest
    assert main(["ckpt", "list", str(run_dir)]) == 0  # verifies each: marking the best changed no file in it
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert listed["2"].split()[1] == "yes" and "* val/score=0.9 (max)" in listed["2"]
    assert listed["5"].split()[1] == "yes" and "val/score" not in listed["5"]
    assert [row["step"] for row in read_metrics(run_dir) if "val/score" in row] == [1, 2, 3, 4, 5]

    # resume (trainer.resume=auto from step 5) to step 7: the best as of step 5 is 0.9, so 0.85 at step 6 is
    # no best (nothing saved), and the last step rotates step 5 out, never step 2
    scripted(RLTrainer(rl_config(run_dir, *KEEP, "trainer.total_steps=7", "trainer.resume=auto")), values).fit()
    assert steps(run_dir) == [2, 7]
    assert read_best(run_dir / "checkpoints").step == 2


def test_a_better_value_moves_the_mark_and_min_mode_keeps_the_smallest(tmp_path):
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, *KEEP, "trainer.total_steps=4", "checkpoint.keep_best_mode=min",
                       "checkpoint.save_interval=2")
    scripted(RLTrainer(config), {1: 0.5, 2: 0.6, 3: 0.2, 4: 0.4}).fit()
    # step 1 (first), step 2 (save_interval, then rotated), step 3 (smaller: the new best), step 4 (last)
    assert steps(run_dir) == [3, 4]
    assert read_best(run_dir / "checkpoints") == BestRecord(3, "val/score", 0.2, "min")
    assert not improves(float("nan"), None, "max") and not improves(0.2, BestRecord(3, "m", 0.2), "min")


@pytest.mark.parametrize("mode", ["max", "min"])
def test_a_tie_is_not_an_improvement(tmp_path, mode):
    """A later step that only equals the best keeps the older checkpoint as the best, in either mode."""
    assert not improves(0.5, BestRecord(1, "val/score", 0.5, mode), mode)
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, *KEEP, "trainer.total_steps=3", f"checkpoint.keep_best_mode={mode}")
    scripted(RLTrainer(config), {1: 0.5, 2: 0.5, 3: 0.5}).fit()
    assert steps(run_dir) == [1, 3]  # step 2 tied: not saved (off save_interval), step 3 is the last
    assert read_best(run_dir / "checkpoints") == BestRecord(1, "val/score", 0.5, mode)


def test_a_fresh_run_forgets_an_old_best(tmp_path):
    run_dir = tmp_path / "run"
    scripted(RLTrainer(rl_config(run_dir, *KEEP, "trainer.total_steps=2")), {1: 0.9, 2: 0.1}).fit()
    assert read_best(run_dir / "checkpoints").step == 1
    scripted(RLTrainer(rl_config(run_dir, "trainer.val_every=1", "trainer.total_steps=1",
                                 "checkpoint.save_total_limit=1")), {1: 0.0}).fit()
    assert read_best(run_dir / "checkpoints") is None and steps(run_dir) == [1]  # the old step 1 was replaced


def test_an_unknown_metric_is_refused_at_the_first_validation_with_the_logged_names(tmp_path):
    trainer = scripted(RLTrainer(rl_config(tmp_path / "run", *KEEP, "checkpoint.keep_best=val/scor",
                                           "trainer.val_before_train=true")), {0: 0.1})
    trainer.step = lambda: pytest.fail("the check comes before the first step")
    with pytest.raises(ConfigError, match=r"checkpoint.keep_best=val/scor: validation logged no such metric. Did you "
                       r"mean 'val/score'\?.* It logs: val/pass@1, val/score. Fix"):
        trainer.fit()


def test_names_validation_never_logs_are_refused_at_start_up(tmp_path):
    def problems(*overrides: str) -> list[str]:
        return [str(p) for p in check_startup(rl_config(tmp_path / "run", *overrides), world_size=1).problems]

    assert any("checkpoint.keep_best=reward/mean: only validation metrics (val/...) are compared" in p
               for p in problems("checkpoint.keep_best=reward/mean"))
    assert any("checkpoint.keep_best=val/math/pass@4: validation never logs it; its metric@k are none" in p
               and "add 4 to rollout.val_k" in p for p in problems("checkpoint.keep_best=val/math/pass@4"))
    assert not problems("checkpoint.keep_best=val/maj@4", "rollout.val_n=4", "rollout.val_temperature=1")
    assert any("rollout.val_k=[1, 8]: pass@k, maj@k and mean@k for k=[8] need at least 8 answers per prompt, and "
               "rollout.val_n=4 samples 4" in p
               for p in problems("rollout.val_n=4", "rollout.val_k=[1,8]", "rollout.val_temperature=1"))


def test_validation_logs_pass_maj_and_mean_at_k(tmp_path):
    """A real validation (the arithmetic env's 0/1 numeric_match) with rollout.val_n=3, val_k=[1, 3]."""
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, "trainer.total_steps=1", "rollout.val_n=3", "rollout.val_k=1,3",
                       "rollout.val_temperature=1.0", "rollout.max_new_tokens=2", reward=None)
    RLTrainer(config).fit()
    (row,) = [r for r in read_metrics(run_dir) if "val/score" in r]
    assert {"val/pass@1", "val/pass@3", "val/maj@1", "val/maj@3", "val/mean@1", "val/mean@3"} <= set(row)
    assert row["val/pass@1"] == pytest.approx(row["val/score"]) == row["val/mean@3"]
    assert row["val/pass@1"] <= row["val/pass@3"]
    json.dumps(row)


def test_async_saves_mark_the_best_once_committed(tmp_path):
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, *KEEP, "trainer.total_steps=3", "checkpoint.async_save=true")
    scripted(RLTrainer(config), {1: 0.3, 2: 0.7, 3: 0.1}).fit()
    assert steps(run_dir) == [2, 3] and read_best(run_dir / "checkpoints").step == 2


def test_sft_keeps_the_smallest_validation_loss(tmp_path):
    from verl.trainer.offline.sft_trainer import SFTTrainer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "output": str(i + 1)}) + "\n" for i in range(8)))
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, "trainer.kind=sft", "data.kind=sft", f"data.train_files=[{data}]", "env.name=null",
                       "data.val_size=2", "sft.batch_size=2", "trainer.total_steps=3", "trainer.val_every=1",
                       "checkpoint.save_total_limit=1", "checkpoint.keep_best=val/loss",
                       "checkpoint.keep_best_mode=min", reward=None)
    trainer = SFTTrainer(config)
    losses = {1: 2.0, 2: 1.0, 3: 1.5}
    trainer.validate = lambda: {"val/loss": losses[trainer.step_count]}
    trainer.fit()
    assert steps(run_dir) == [2, 3] and read_best(run_dir / "checkpoints") == BestRecord(2, "val/loss", 1.0, "min")
