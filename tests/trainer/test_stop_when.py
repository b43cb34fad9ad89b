"""`trainer.stop_when`: training ends at the first validation after a step whose metric reaches the value, that
step is saved as the last checkpoint, a rerun of the same command trains no further, and a rule that could
never act (a metric validation never logs, a run that validates only at its end) is refused. The validations
are scripted (a value per step) so the step that ends the run is known."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rl_support import read_metrics, rl_config

from verl.checkpoint import list_checkpoints
from verl.config.run_settings import parse_stop_rule
from verl.errors import ConfigError
from verl.trainer.checks.startup import check_startup
from verl.trainer.rl_trainer import RLTrainer

STOP = ("trainer.val_every=1", "checkpoint.save_interval=0", "rollout.max_new_tokens=2", "trainer.total_steps=6")


def scripted(trainer: RLTrainer, values: dict[int, float]) -> RLTrainer:
    trainer.validate = lambda: {"val/score": values[trainer.step_count], "val/loss": 1 - values[trainer.step_count]}
    return trainer


def saved_steps(run_dir) -> list[int]:
    return [c.step for c in list_checkpoints(run_dir, verify_files=False)]


def test_training_ends_at_the_first_validation_that_reaches_the_value_and_a_rerun_trains_no_further(tmp_path,
                                                                                                   capsys):
    run_dir = tmp_path / "run"
    values = {0: 0.99, 1: 0.2, 2: 0.5, 3: 0.8, 4: 0.9, 5: 0.95, 6: 1.0}
    # the validation before training already passes 0.8: it does not count (nothing was trained)
    config = rl_config(run_dir, *STOP, "trainer.stop_when=val/score>=0.8", "trainer.val_before_train=true",
                       "logging.backends=[console,jsonl]")
    trainer = scripted(RLTrainer(config), values)
    trainer.fit()
    assert trainer.step_count == 3
    assert saved_steps(run_dir) == [3]  # the step that ended it is the run's last checkpoint
    assert [row["step"] for row in read_metrics(run_dir) if "val/score" in row] == [0, 1, 2, 3]
    out = capsys.readouterr().out
    assert "step 3: val/score=0.8 reached trainer.stop_when=val/score>=0.8: training ends here" in out

    again = scripted(RLTrainer(config.model_copy(update={
        "trainer": config.trainer.model_copy(update={"resume": "auto"})})), values)
    again.step = lambda: pytest.fail("a rerun of a run stop_when ended trains no further")
    again.fit()
    assert again.step_count == 3 and saved_steps(run_dir) == [3]
    assert "trainer.stop_when=val/score>=0.8 ended this run there; nothing to train" in capsys.readouterr().out

    # another rule (here: a higher bar) trains on from the checkpoint
    higher = scripted(RLTrainer(rl_config(run_dir, *STOP, "trainer.stop_when=val/score>=0.95",
                                                 "trainer.resume=auto")), values)
    higher.fit()
    assert higher.step_count == 5


def test_a_lower_is_better_rule_and_nan_never_ending_a_run(tmp_path):
    trainer = scripted(RLTrainer(rl_config(tmp_path / "a", *STOP, "trainer.stop_when=val/loss<=0.1")),
                       {1: 0.5, 2: 0.85, 3: 0.9, 4: 0.2, 5: 0.2, 6: 0.2})
    trainer.fit()
    assert trainer.step_count == 3  # val/loss 1 - 0.9 = 0.1 (within float rounding of 0.1: 0.09999...)
    nan = scripted(RLTrainer(rl_config(tmp_path / "b", *STOP, "trainer.stop_when=val/score>=0.5")),
                   dict.fromkeys(range(7), float("nan")))
    nan.fit()
    assert nan.step_count == 6


def test_an_unknown_metric_is_refused_at_the_first_validation_with_the_logged_names(tmp_path):
    trainer = scripted(RLTrainer(rl_config(tmp_path / "run", *STOP, "trainer.stop_when=val/scor>=0.5",
                                           "trainer.val_before_train=true")), {0: 0.1})
    trainer.step = lambda: pytest.fail("the check comes before the first step")
    with pytest.raises(ConfigError, match=r"trainer.stop_when=val/scor: validation logged no such metric. Did you "
                       r"mean 'val/score'\?.* It logs: val/loss, val/score. Fix"):
        trainer.fit()


@pytest.mark.parametrize("rule", ["val/accuracy>0.9", "accuracy", ">=0.9", "val/accuracy>=high", "a>=0.9 b",
                                  "val/accuracy=>0.9", "val/accuracy>=0.9; rm -rf /"])
def test_a_malformed_rule_is_refused_when_the_config_loads(tmp_path, rule):
    with pytest.raises((ConfigError, ValidationError), match="is not METRIC>=VALUE or METRIC<=VALUE"):
        rl_config(tmp_path / "run", f"trainer.stop_when={rule}")


def test_rules_that_could_never_act_are_refused_at_start_up(tmp_path):
    def problems(*overrides: str) -> list[str]:
        return [str(p) for p in check_startup(rl_config(tmp_path / "run", *overrides), world_size=1).problems]

    assert parse_stop_rule(" val/loss <= 1e-2 ") == ("val/loss", "<=", 0.01)
    assert any("trainer.stop_when=reward/mean>=1: only validation metrics (val/...) are read" in p
               for p in problems("trainer.stop_when=reward/mean>=1", "trainer.val_every=5"))
    assert any("trainer.val_every=0 validates only after the last step. Fix: set trainer.val_every" in p
               for p in problems("trainer.stop_when=val/score>=0.9", "trainer.val_every=0"))
    assert any("trainer.stop_when=val/pass@4: validation never logs it" in p
               for p in problems("trainer.stop_when=val/pass@4>=0.5", "trainer.val_every=5"))
    assert not [p for p in problems("trainer.stop_when=val/score>=0.9", "trainer.val_every=5") if "stop_when" in p]
