"""On-policy distillation against GRPO on the arithmetic demo: held-out accuracy after the same RL wall time.

A teacher is trained first: the demo itself (`verl train`: warm start, then GRPO for its 400 steps) with
`--teacher-seed` (default 3), exported with `verl ckpt export`. Then, for each seed, the same warm start (same seed,
same steps) continues three ways, each in its own process, one after the other:
- `grpo`: the demo's GRPO;
- `distill`: distillation alone (`algorithm.distill.teacher_path=TEACHER algorithm.distill.task_reward=false`:
  the reverse KL to the teacher as per-token advantages, no reward);
- `distill+task`: the same term added to GRPO's advantages.
Held-out accuracy is read at every validation (`--val-every` steps) with the RL time spent until then (the
sum of `timing/step`, validation excluded); the table compares the three at the wall time of the shortest
run, so a variant that is slower per step (the teacher's forward) pays for it.
Run by hand: ``python benchmarks/distill_seeds.py [--seeds 1 2 3] [--steps 150] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_runs import ROOT, metric_rows, run_verl  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    "distill": ["algorithm.distill.task_reward=false"],
    "distill+task": [],
}


def train_teacher(root: Path, seed: int) -> Path:
    """The demo run with `seed`, exported as a Hugging Face folder (reused when it exists)."""
    out = root / f"teacher-seed-{seed}"
    if (out / "config.json").is_file():
        return out
    run_dir = root / f"teacher-run-{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_verl("train", f"trainer.seed={seed}", f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]")
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    run_verl("ckpt", "export", str(run_dir / "checkpoints" / Path(latest).name), "--out", str(out))
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"teacher (seed {seed}): held-out {summary['accuracy_after_rl']:.1%} after GRPO", flush=True)
    return out


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, RL seconds until then, held-out accuracy) at every validation."""
    seconds, out = 0.0, []
    for row in metric_rows(run_dir):
        seconds += float(row.get("timing/step", 0.0))
        if "val/accuracy" in row:
            out.append((int(row.get("step", 0)), seconds, float(row["val/accuracy"])))
    return out


def accuracy_at(points: list[tuple[int, float, float]], budget: float) -> float:
    """The last validation reached within `budget` RL seconds."""
    return [acc for _, seconds, acc in points if seconds <= budget + 1e-9][-1]


def run_variant(name: str, seed: int, teacher: Path, steps: int, val_every: int, root: Path,
                overrides: list[str]) -> list[tuple[int, float, float]]:
    run_dir = root / f"{name}-seed-{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    distill = [f"algorithm.distill.teacher_path={teacher}"] if name.startswith("distill") else []
    run_verl("train", f"trainer.seed={seed}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
             f"trainer.val_every={val_every}", "logging.backends=[jsonl]", *distill, *VARIANTS[name], *overrides,
             what=f"{name} seed {seed}")
    return curve(run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--teacher-seed", type=int, default=3,
                        help="the demo seed whose run is the teacher "
                             "(3: one of the seeds the demo takes to over 90%% held-out)")
    parser.add_argument("--steps", type=int, default=150, help="RL steps of each student run")
    parser.add_argument("--val-every", type=int, default=15)
    parser.add_argument("--run-root", type=Path, default=ROOT / "runs" / "distill-seeds")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every student run")
    args = parser.parse_args(argv)
    teacher = train_teacher(args.run_root, args.teacher_seed)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    starts = []
    for seed in args.seeds:
        curves = {name: run_variant(name, seed, teacher, args.steps, args.val_every, args.run_root, args.overrides)
                  for name in VARIANTS}
        budget = min(points[-1][1] for points in curves.values())  # the shortest run's RL time
        starts.append(curves["grpo"][0][2])
        line = [f"seed {seed}: after SFT {starts[-1]:.1%}; at {budget:.0f} s of RL"]
        for name, points in curves.items():
            results[name].append(accuracy_at(points, budget))
            line.append(f"{name} {results[name][-1]:.1%} ({points[-1][0]} steps in {points[-1][1]:.0f} s)")
        print(", ".join(line), flush=True)
    for name, accs in results.items():
        spread = f" +- {100 * statistics.stdev(accs):.1f}" if len(accs) > 1 else ""
        print(f"variant {name}: held-out {100 * statistics.mean(accs):.1f}%{spread} after the same RL wall time "
              f"[{', '.join(f'{a:.1%}' for a in accs)}], from {100 * statistics.mean(starts):.1f}% after SFT")
    gains = [d - g for d, g in zip(results["distill"], results["grpo"], strict=True)]
    print(f"ratio distill over grpo: {sum(g > 0 for g in gains)}/{len(gains)} seeds ahead, "
          f"{100 * statistics.mean(gains):+.1f} pts on average at equal wall time")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import doc_table

    raise SystemExit(
        doc_table.run(main, doc_table.prefixed("variant ", "ratio "), doc=doc_table.ROOT / "docs" / "training.md")
    )
