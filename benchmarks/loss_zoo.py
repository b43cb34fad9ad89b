"""Every registered policy loss on the arithmetic demo: held-out accuracy after RL and RL steps to 80%.

Each (loss, seed) is one `verl train` of the demo (its warm start, then RL with `actor.policy_loss=LOSS` and
the loss's default options), in its own process, one after the other. The held-out accuracy is read from
the run's metrics.jsonl at every validation (`--val-every` steps), so "steps to 80%" is the first
validation step at or above 80% ("-" if none). The full run (6 losses x 3 seeds x 400 steps, ~3 min each on
one core, more on a busy machine) takes about an hour with `--jobs 1`; `--jobs N` runs N at once on a
machine with the cores; `--steps`, `--seeds` and `--losses` make shorter runs, and the table's command line
says which was run. `--write-docs` puts the summary lines into docs/training.md.
Run by hand: ``python benchmarks/loss_zoo.py [--seeds 1 2 3] [--steps 400] [--losses ppo gspo] [key=value ...]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from verl.algorithms.policy_losses import POLICY_LOSS_NAMES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_runs import run_verl, validations  # noqa: E402

TARGET = 0.8
# what each loss's paper pairs it with, beyond its own options (the table names them)
PAIRED: dict[str, list[str]] = {"gspo": ["actor.loss_agg=seq-mean-token-mean"],
                                "gmpo": ["actor.loss_agg=seq-mean-token-mean"]}


def run_one(loss: str, seed: int, steps: int | None, val_every: int, run_root: Path,
            overrides: list[str]) -> dict[str, Any]:
    run_dir = run_root / f"{loss}-seed-{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run: resume: auto would otherwise continue the old one
    run_verl("train", f"actor.policy_loss={loss}", *PAIRED.get(loss, []), f"trainer.seed={seed}",
             f"trainer.run_dir={run_dir}", f"trainer.val_every={val_every}", "logging.backends=[jsonl]",
             *([f"trainer.total_steps={steps}"] if steps else []), *overrides, what=f"{loss} seed {seed}")
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = validations(run_dir)
    reached = [step for step, acc in curve if acc >= TARGET and step > 0]
    summary["steps_to_target"] = reached[0] if reached else None
    summary["curve"] = curve
    return summary


def summary_line(loss: str, runs: list[dict[str, Any]]) -> str:
    after = [r["accuracy_after_rl"] for r in runs]
    reach = [r["steps_to_target"] for r in runs]
    spread = f" +- {100 * statistics.stdev(after):.1f}" if len(after) > 1 else ""
    paired = f" ({', '.join(PAIRED[loss])})" if loss in PAIRED else ""
    return (f"loss {loss}{paired}: held-out after RL {100 * statistics.mean(after):.1f}%{spread} "
            f"[{', '.join(f'{a:.1%}' for a in after)}], after SFT "
            f"{100 * statistics.mean(r['accuracy_after_sft'] for r in runs):.1f}%, steps to {TARGET:.0%}: "
            f"{' / '.join('-' if s is None else str(s) for s in reach)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", nargs="+", default=list(POLICY_LOSS_NAMES), choices=POLICY_LOSS_NAMES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the demo's 400)")
    parser.add_argument("--val-every", type=int, default=25, help="validate every N steps (steps to 80%%)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each uses one core: trainer.cpu_threads)")
    parser.add_argument("--run-root", type=Path, default=ROOT / "runs" / "loss-zoo")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args(argv)
    jobs = [(loss, seed) for loss in args.losses for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:  # each run is its own process
        futures = {job: pool.submit(run_one, *job, args.steps, args.val_every, args.run_root, args.overrides)
                   for job in jobs}
        for loss in args.losses:
            runs = []
            for seed in args.seeds:
                run = futures[(loss, seed)].result()
                runs.append(run)
                print(f"  {loss} seed {seed}: {run['accuracy_after_sft']:.1%} -> {run['accuracy_after_rl']:.1%} in "
                      f"{run['steps']} steps, {run['wall_seconds']:.0f} s; steps to {TARGET:.0%}: "
                      f"{run['steps_to_target'] or '-'}", flush=True)
            print(summary_line(loss, runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.prefixed("loss "), doc=doc_table.ROOT / "docs" / "training.md"))
