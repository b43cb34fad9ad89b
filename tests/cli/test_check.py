"""`verl check`: the trainer's start-up checks without training."""

from pathlib import Path

import pytest

from verl.cli.main import main
from verl.demos.arithmetic import demo_config_path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["grpo_gsm8k.yaml", "ppo_gsm8k.yaml"])
def test_examples_pass_every_check_but_the_model(name, capsys, tmp_path, monkeypatch):
    """The GSM8K examples keep their real model path; the only problem `verl check` reports here is that the
    model is not downloaded (their sample data fills a batch of 64 prompts)."""
    monkeypatch.chdir(tmp_path)  # data paths resolve next to the YAML
    assert main(["check", str(EXAMPLES / name)]) == 1
    out = capsys.readouterr().out
    assert out.count("problem:") == 1 and "Qwen2.5-0.5B-Instruct does not exist" in out
    assert "72/72 rows kept" in out and "8/8 rows kept" in out and "reward functions: numeric_match" in out
    assert "batches (actor)" in out


def test_demo_preset_passes(capsys):
    assert main(["check", demo_config_path()]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "model and tokenizer are consistent" in out
    assert "linear layers on CPU: " in out and "trainer.cpu_matmul=auto: " in out


def test_the_cpu_matmul_library_is_named(capsys):
    assert main(["check", demo_config_path(), "trainer.cpu_matmul=aten"]) == 0
    assert "linear layers on CPU: ATen (MKL) (trainer.cpu_matmul=aten: as set)" in capsys.readouterr().out


def test_impossible_mapping_is_reported_before_loading(capsys):
    assert main(["check", demo_config_path(), "--nproc", "2", "--actor_device_ids", "0,1,2"]) == 1
    out = capsys.readouterr().out
    assert "devices.actor has rank(s) [2] outside the world of 2" in out and "nothing was loaded" in out
