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
    assert "reward calls: up to 4 at once on threads (reward.executor=thread), 60 s each at most" in out


def test_demo_preset_passes(capsys):
    assert main(["check", demo_config_path()]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "model and tokenizer are consistent" in out
    assert "linear layers on CPU: " in out and "trainer.cpu_matmul=auto: " in out
    assert "note: old log-probs (where the update needs them): the sampler's: the hf engine samples with the " \
           "trainer's own float32 weights" in out
    assert "note: rollout correction: off: actor.old_logprobs takes the sampler's log-probs" in out


def test_the_rollout_correction_mode_and_its_reason_are_printed(capsys):
    main(["check", demo_config_path(), "actor.rollout_correction.mode=seq_tis_geo"])
    assert ("note: rollout correction: seq_tis_geo (cap 2.0): set by actor.rollout_correction.mode=seq_tis_geo"
            in capsys.readouterr().out)


def test_the_cpu_matmul_library_is_named(capsys):
    assert main(["check", demo_config_path(), "trainer.cpu_matmul=aten"]) == 0
    assert "linear layers on CPU: ATen (MKL) (trainer.cpu_matmul=aten: as set)" in capsys.readouterr().out


def test_impossible_mapping_is_reported_before_loading(capsys):
    assert main(["check", demo_config_path(), "--nproc", "2", "--actor_device_ids", "0,1,2"]) == 1
    out = capsys.readouterr().out
    assert "devices.actor has rank(s) [2] outside the world of 2" in out and "nothing was loaded" in out


def test_check_uses_the_world_train_would_run(capsys):
    """`verl check` checks the one process `verl train` would start without --nproc, so a mapping that
    needs six processes is a problem with the launch that fixes it; `--nproc 6` checks that launch."""
    argv = ["check", demo_config_path(), "devices.actor=[0,1,2,3,4,5]"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "run: trainer.kind=rl, 1 process(es) (as `verl train` without --nproc" in out
    assert ("devices.actor has rank(s) [1, 2, 3, 4, 5] outside the world of 1 process(es) (valid: 0..0). Fix: "
            "launch 6 processes (`verl train --nproc 6`, or torchrun --nproc_per_node=6)") in out
    main([*argv, "--nproc", "6"])
    out = capsys.readouterr().out
    assert "run: trainer.kind=rl, 6 process(es)\n" in out and "outside the world" not in out
    main([*argv, "--nproc", "3", "--nnodes", "2"])
    assert "run: trainer.kind=rl, 6 process(es)\n" in capsys.readouterr().out
    assert main(["check", demo_config_path(), "--nnodes", "2"]) == 1
    assert "--nnodes 2 without --nproc" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a GPU run on a machine without a GPU")
def test_a_gpu_run_is_checked_as_it_will_run_on_a_machine_without_a_gpu(capsys):
    """A login node without a GPU checks the `trainer.device=cuda` run it will launch: cuda devices, bfloat16
    compute (the memory plan's sizes), no CPU kernel line; and says what it assumed."""
    assert main(["check", demo_config_path(), "trainer.device=cuda", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: this machine has no GPU: checked as the trainer.device=cuda run" in out
    assert "cuda:0,cuda:1" in out and "bfloat16 compute" in out
    assert "float32 compute" not in out and "linear layers on CPU" not in out and "all checks passed" in out
    assert main(["check", demo_config_path(), "--nproc", "2"]) == 0  # auto: this machine's CPU
    out = capsys.readouterr().out
    assert "no GPU" not in out and "linear layers on CPU" in out and "computed in float32" in out
