"""Tensor parallelism on GPUs over NCCL (`actor.tensor_parallel_size=2`, `verl train --nproc 2`, as a user runs
it) against one GPU: the CPU/gloo version is tests/distributed/test_rl_tensor_parallel.py, whose config this
reuses on CUDA. Marked `gpu`; skipped with fewer than 2 CUDA GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))
from test_rl_tensor_parallel import STEP1, _config  # noqa: E402


def _train(cfg: Path, nproc: int, cwd: Path) -> list[dict]:
    config = yaml.safe_load(cfg.read_text())
    config["trainer"].update(device="cuda")
    config["trainer"].pop("cpu_matmul", None)
    cfg.write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "NVIDIA_TF32_OVERRIDE": "0"}
    out = subprocess.run([sys.executable, "-m", "verl.cli.main", "train", "--nproc", str(nproc), str(cfg)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run = Path(config["trainer"]["run_dir"])
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tp2_on_two_gpus_trains_as_one_gpu(tmp_path):
    split = _train(_config(tmp_path, "tp2", 2), 2, tmp_path)
    whole = _train(_config(tmp_path, "one", 1), 1, tmp_path)
    assert [r["step"] for r in split] == [r["step"] for r in whole] == [0, 1, 2, 3]
    one, ref = split[1], whole[1]
    for key in STEP1:  # float32 on both; NCCL's and cuBLAS's reduction orders differ from one GPU's
        assert one[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), key
    assert one["reward/mean"] == ref["reward/mean"]  # the same samples
    assert one["actor/kl_loss"] == ref["actor/kl_loss"] == 0.0
    for row in split[2:]:
        assert row["actor/kl_loss"] > 0 and row["actor/grad_norm"] > 0
