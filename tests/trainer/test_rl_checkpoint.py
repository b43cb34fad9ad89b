"""Trainer checkpoints under a hard kill, and their export to a Hugging Face folder."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rl_support import deterministic_rows, read_metrics, rl_config

from verl.checkpoint import list_checkpoints
from verl.cli.main import main as verl_main
from verl.config import config_to_yaml, load_config
from verl.trainer.rl_trainer import RLTrainer

TOTAL = 10
OVERRIDES = (f"trainer.total_steps={TOTAL}", "actor.mini_batch_size=2", "actor.lr_schedule=cosine")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run, never interrupted and never saved until the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_dir = tmp_path_factory.mktemp("reference")
        trainer = RLTrainer(rl_config(run_dir, *OVERRIDES))
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}, deterministic_rows(read_metrics(run_dir))


def _committed_steps(run_dir: Path) -> list[int]:
    if not (run_dir / "checkpoints").is_dir():
        return []
    return [info.step for info in list_checkpoints(run_dir, verify_files=False)]


def _trial(tmp_path: Path, reference, seed: int) -> None:
    rng = random.Random(seed)
    run_dir = tmp_path / f"run{seed}"
    yaml_path = tmp_path / f"run{seed}.yaml"
    config = rl_config(run_dir, *OVERRIDES, "checkpoint.save_interval=1", "trainer.resume=auto")
    yaml_path.write_text(config_to_yaml(config), encoding="utf-8")
    kill_after = rng.randint(1, TOTAL // 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "verl.cli", "train", str(yaml_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(s >= kill_after for s in _committed_steps(run_dir)):
            assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint appeared within 120 s"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))  # somewhere in the next step or the next save
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill"
    infos = list_checkpoints(run_dir)
    assert infos and all(info.problems == [] for info in infos), [info.problems for info in infos]
    resumed_from = max(info.step for info in infos)
    assert resumed_from < TOTAL

    trainer = RLTrainer(load_config(str(yaml_path)))
    trainer.fit()
    assert trainer.step_count == TOTAL
    assert trainer.history[0]["step"] == 1  # the history is carried in the checkpoint
    ref_state, ref_rows = reference
    assert all(torch.equal(v, ref_state[k]) for k, v in trainer.model.state_dict().items())
    assert deterministic_rows(read_metrics(run_dir)) == ref_rows  # no duplicated or lost step
    assert max(info.step for info in list_checkpoints(run_dir)) == TOTAL
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp" in p.name]


def test_sigkill_then_resume_auto_finishes_exactly(tmp_path, reference):
    _trial(tmp_path, reference, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_sigkill_then_resume_auto_many(tmp_path, reference, seed):
    _trial(tmp_path, reference, seed)


def test_ckpt_export_reloads_with_identical_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = RLTrainer(rl_config(tmp_path / "run", "trainer.total_steps=2"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.fit()
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    (info,) = list_checkpoints(tmp_path / "run")
    out = tmp_path / "hf"
    assert verl_main(["ckpt", "export", str(info.path), "--out", str(out)]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out

    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = ["3+4=", "12-5= 7"]
    assert [tokenizer(t)["input_ids"] for t in text] == [trainer.tokenizer(t)["input_ids"] for t in text]
    ids = torch.tensor([trainer.tokenizer("9+9=18 and 2+2=4")["input_ids"]])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    assert torch.equal(got, expected)
    # exporting twice into the same folder is refused rather than mixing two models
    assert verl_main(["ckpt", "export", str(info.path), "--out", str(out)]) == 1
    assert "exists and is not empty" in " ".join(capsys.readouterr().err.split())
