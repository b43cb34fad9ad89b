"""`verl train --nproc N`: the start-up checks run once in the launching process; errors print once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl.distributed.launch import RANK_ERRORS_ENV, read_rank_errors, write_rank_error
from verl.errors import ModelError, RewardError

CONFIG = """\
model: {{path: {model}, dtype: float32}}
data: {{train_files: [prompts.jsonl], train_batch_size: {batch}, max_prompt_length: 32}}
reward: {{functions: [{{name: numeric_match}}]}}
rollout: {{n: 2, max_new_tokens: 3}}
actor: {{micro_batch_size: 2, mini_batch_size: 2}}
trainer: {{total_steps: 1, device: cpu, val_before_train: false, run_dir: {run_dir}, resume: never}}
logging: {{backends: [jsonl]}}
"""


def _project(tmp_path: Path, *, batch: int, model: str = "tiny") -> Path:
    rows = [{"prompt": f"{a}+1=", "ground_truth": str(a + 1)} for a in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(model=model, batch=batch, run_dir=tmp_path / "run"), encoding="utf-8")
    return path


def _verl(*args: str, cwd: Path, timeout: float = 300,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", RANK_ERRORS_ENV)}
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "verl.cli", *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def test_startup_problem_prints_once_without_spawning(tmp_path):
    cfg = _project(tmp_path, batch=8)  # 4 prompts, 8 per step
    out = _verl("train", str(cfg), "--nproc", "3", cwd=tmp_path)
    assert out.returncode == 1
    err = out.stderr
    assert err.count("data.train_batch_size=8 prompts per step") == 1
    assert err.startswith("error (ConfigError): start-up checks failed (nothing was loaded)")
    assert "Traceback" not in err and "ChildFailedError" not in err and "torchrun" not in err
    assert not (tmp_path / "run").exists()  # no worker ever started


def test_rank_errors_are_grouped_by_message(tmp_path):
    write_rank_error(RewardError("same"), tmp_path, 2)
    write_rank_error(RewardError("same"), tmp_path, 0)
    write_rank_error(ModelError("other [/INST]"), tmp_path, 1)
    (tmp_path / "rank-3.json").write_text("{trunc", encoding="utf-8")  # killed mid-write: ignored
    assert read_rank_errors(tmp_path) == [("RewardError", "same", [0, 2]), ("ModelError", "other [/INST]", [1])]


@pytest.mark.slow
def test_worker_error_prints_once_with_its_ranks(tmp_path):
    """Weights only the workers read are broken: each worker fails the same way; the launcher prints it once,
    with no torchrun traceback."""
    from verl.trainer.build.models import resolve_model_path

    broken = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny"), broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    cfg = _project(tmp_path, batch=2, model=str(broken))
    out = _verl("train", str(cfg), "--nproc", "2", cwd=tmp_path)
    assert out.returncode == 1
    err = out.stderr
    assert err.count("error (ModelError) on every rank (2): could not load the weights") == 1, err[-3000:]
    assert "could not load the weights of model" in err
    assert "Traceback" not in err and "ChildFailedError" not in err


def _missing_backend() -> str:
    from importlib.util import find_spec

    missing = [name for name in ("wandb", "mlflow", "tensorboard") if find_spec(name) is None]
    if not missing:
        pytest.skip("every optional logging backend is installed here")
    return missing[0]


def test_missing_logging_backend_prints_once_without_spawning(tmp_path):
    """A logging backend that is not installed is a start-up problem of the launching process: printed once
    with the install hint, and no worker starts (before: every worker loaded the model, then failed)."""
    backend = _missing_backend()
    cfg = _project(tmp_path, batch=4)
    out = _verl("train", str(cfg), f"logging.backends=[{backend}]", "--nproc", "2", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith("error (ConfigError): start-up checks failed (nothing was loaded); `verl check "
                                 "CONFIG` lists the same 1 problem(s)"), out.stderr
    assert out.stderr.count(f"logging.backends has '{backend}' but it is not installed. Fix: pip install "
                            f"{backend}") == 1, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_offline_hub_id_prints_once_without_spawning(tmp_path):
    """Under --nproc the hub probe runs in the launching process only: one message, in seconds."""
    cfg = _project(tmp_path, batch=4, model="Qwen/Qwen2.5-0.5B-Instruct")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = _verl("train", str(cfg), "--nproc", "2", cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 1
    assert out.stderr.startswith("error (ModelError): start-up checks failed (nothing was loaded); `verl check "
                                 "CONFIG` lists the same 1 problem(s)"), out.stderr
    assert out.stderr.count("model.path=Qwen/Qwen2.5-0.5B-Instruct is a Hugging Face hub id that is not on "
                            "this machine") == 1, out.stderr
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()
