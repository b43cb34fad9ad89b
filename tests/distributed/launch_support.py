"""`verl train` in 1..N gloo processes, as a user launches it, for the multi-process trainer tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def verl_train(config: Path, cwd: Path, nproc: int = 1, script: Path | None = None) -> subprocess.CompletedProcess:
    """Run `verl train CONFIG` (under torchrun when nproc > 1); fails the test with the output tail.

    `script` runs `python SCRIPT CONFIG` instead of `verl train` (e.g. a trainer subclass)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    entry = [str(script)] if script is not None else ["-m", "verl.cli.main", "train"]
    args = [sys.executable, *launcher, *entry, str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
