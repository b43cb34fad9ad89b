"""`verl eval`: the tiny model on a small dataset writes JSON with metric@k overall and per data_source; a
checkpoint evaluated with its run's config gives exactly the validation numbers the run logged at that step;
bad input (k > n, a checkpoint that does not verify, a stray argument) is a clear error."""

from __future__ import annotations

import json

import pytest
from rl_support import HERE, rl_config

from verl.cli.eval_cmd import parse_ks, split_items
from verl.cli.main import main
from verl.errors import CheckpointError, ConfigError
from verl.trainer.eval_run import eval_config, resolve_source, run_eval
from verl.trainer.rl_trainer import RLTrainer

REWARD = f"{HERE / 'test_eval_run.py'}:even_first_char"
FAST = ["trainer.device=cpu", "model.dtype=float32", "rollout.max_new_tokens=2", "trainer.cpu_threads=1"]


def even_first_char(prompt, response, ground_truth, **metadata):  # about half of the answers score 1
    return float(bool(response) and ord(response[0]) % 2 == 0)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "test.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i), "data_source": "gsm8k" if i < 4 else "math"}
            for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_verl_eval_writes_metrics_overall_and_per_data_source(tmp_path, data, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", "tiny", str(data), "--n", "4", "--k", "1", "2", "4", f"reward.functions=[{REWARD}]", *FAST,
                 "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert (result["model"], result["rows"], result["n"], result["k"]) == ("tiny", 6, 4, [1, 2, 4])
    assert result["temperature"] == 1.0  # n > 1 with a greedy config: sampled, and said so
    assert any("temperature 1.0" in note for note in result["notes"])
    assert result["source_rows"] == {"gsm8k": 4, "math": 2}
    assert result["data_report"]["kept_rows"] == 6
    metrics, by_source = result["metrics"], result["by_data_source"]
    assert set(by_source) == {"gsm8k", "math"}
    for part in (metrics, *by_source.values()):
        assert {"score", "accuracy", "pass@1", "pass@2", "pass@4", "maj@1", "maj@4", "mean@4"} <= set(part)
        assert part["pass@1"] == pytest.approx(part["score"]) and part["mean@2"] == part["score"]
        assert part["pass@1"] <= part["pass@2"] <= part["pass@4"]
    assert 0 < metrics["score"] < metrics["pass@4"]  # the answers differ
    assert metrics["score"] == pytest.approx((4 * by_source["gsm8k"]["score"] + 2 * by_source["math"]["score"]) / 6)
    printed = capsys.readouterr().out
    assert "pass@4" in printed and "gsm8k" in printed and "math" in printed


def test_k_larger_than_n_is_a_clear_error(data, capsys):
    assert main(["eval", "tiny", str(data), "--n", "2", "--k", "1,4", f"reward.functions=[{REWARD}]", *FAST]) == 1
    err = capsys.readouterr().err
    assert "--k (rollout.val_k)=[1, 4]: pass@k, maj@k and mean@k for k=[4] need at least 4 answers per prompt" in err
    assert "Fix: raise --n (rollout.val_n) to 4 or drop [4] from --k (rollout.val_k)" in err


def test_the_command_line_is_read_as_model_data_and_overrides():
    assert split_items(["m", "d.jsonl", "a.b=1"]) == ("m", "d.jsonl", ["a.b=1"])
    assert split_items(["m"]) == ("m", None, [])
    assert parse_ks(["1,2", "8", "rollout.top_p=0.9"]) == ([1, 2, 8], ["rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match="verl eval takes MODEL and at most one DATA file"):
        split_items(["m", "a.jsonl", "b.jsonl"])
    with pytest.raises(ConfigError, match="verl eval needs a MODEL"):
        split_items(["a.b=1"])
    with pytest.raises(ConfigError, match="--k x: k values are integers"):
        parse_ks(["x"])


def test_a_checkpoint_gives_the_validation_numbers_its_run_logged(tmp_path):
    """The same code: a run validates (3 sampled answers, k = 1, 3) after each step; `verl eval` of each
    checkpoint, with the run's config and validation rows, reproduces that step's numbers exactly."""
    run_dir = tmp_path / "run"
    config = rl_config(run_dir, "trainer.total_steps=2", "trainer.val_every=1", "checkpoint.save_interval=1",
                       "rollout.val_n=3", "rollout.val_k=[1,3]", "rollout.val_temperature=1.0",
                       "rollout.max_new_tokens=3", "env.kwargs.num_val=6")
    history = RLTrainer(config).fit()
    logged = {row["step"]: {k[4:]: v for k, v in row.items() if k.startswith("val/")} for row in history}
    for model, step in ((run_dir / "checkpoints" / "step_1", 1), (run_dir, 2)):  # a run folder: its latest
        source = resolve_source(str(model))
        assert source.step == step
        eval_cfg, _ = eval_config(source)
        result = run_eval(eval_cfg, source)
        assert result.rows == 6 and result.k == [1, 3] and result.data == "env arithmetic: validation set"
        assert result.metrics == pytest.approx(logged[step], abs=1e-12)
        assert set(result.metrics) == set(logged[step])


def test_a_checkpoint_that_does_not_verify_is_refused(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"step_3: refusing to evaluate a checkpoint that does not verify"):
        resolve_source(str(step))
    with pytest.raises(CheckpointError, match="a run folder without checkpoints"):
        resolve_source(str(tmp_path / "empty_run"))


@pytest.fixture(autouse=True)
def _empty_run(tmp_path):
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)


def test_a_checkpoint_without_its_run_config_and_a_config_without_held_out_rows_are_explained(tmp_path, data):
    import torch

    from verl.checkpoint import CheckpointManager

    CheckpointManager(tmp_path / "bare", save_interval=1).save(1, app_state={"model": torch.nn.Linear(2, 2)},
                                                                extra={})
    with pytest.raises(CheckpointError, match=r"holds no config_yaml, so the model it was trained from is unknown. "
                       "Fix: `verl ckpt export` it"):
        resolve_source(str(tmp_path / "bare" / "checkpoints" / "step_1"))
    config, _ = eval_config(resolve_source("tiny"), None, ["env.name=null", f"data.train_files=[{data}]",
                                                           f"reward.functions=[{REWARD}]", *FAST])
    with pytest.raises(ConfigError, match=r"tiny: its config has no validation rows .* Fix: pass a DATA file"):
        run_eval(config, resolve_source("tiny"))
