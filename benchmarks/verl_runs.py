"""Running `verl` from a benchmark: each run in its own process, on this checkout, one torch thread unless
OMP_NUM_THREADS says otherwise; a failed run stops the benchmark with the command and the output's tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_verl(*args: str, what: str = "verl") -> subprocess.CompletedProcess:
    """`python -m verl.cli.main ARGS` from the repository root with this checkout first on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "verl.cli.main", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what}: `{' '.join(cmd)}` failed with exit code {proc.returncode}:\n"
                         f"{proc.stderr[-3000:] or proc.stdout[-3000:]}")
    return proc


def example_summaries(example: Path, seeds: list[int], run_root: str | Path,
                      overrides: list[str]) -> list[tuple[dict[str, Any], str]]:
    """`verl train EXAMPLE trainer.seed=S` for each seed, one after the other (its output shown as it runs), and
    each run's summary.json with the load average at its end (the runs' times depend on it)."""
    from ab import load_average

    out = []
    for seed in seeds:
        run_dir = Path(run_root).resolve() / f"seed{seed}"
        cmd = [sys.executable, "-m", "verl.cli.main", "train", str(example), f"trainer.seed={seed}",
               f"trainer.run_dir={run_dir}", "trainer.resume=never", *overrides]
        subprocess.run(cmd, check=True, cwd=ROOT)
        out.append((json.loads((run_dir / "summary.json").read_text()), load_average()))
    return out


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def validations(run_dir: Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) at every validation of a run."""
    return [(int(r.get("step", 0)), float(r["val/accuracy"])) for r in metric_rows(run_dir) if "val/accuracy" in r]
