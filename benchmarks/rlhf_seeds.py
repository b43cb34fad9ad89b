"""Run the RLHF pipeline demo (`verl train examples/rlhf_pipeline.yaml`: SFT, a reward model trained on
preferences, GRPO on that reward model alone) on several seeds, one after the other, and print a table.

`python benchmarks/rlhf_seeds.py [--seeds 1 2 3] [--kl 0.05 0] [--negatives all policy] [key=value ...]
[--write-docs]` runs every seed at every `actor.kl_loss_coef` of `--kl` (default: the example's own only) and for
every kind of reward-model negatives of `--negatives` (`all`: the SFT policy's wrong answers plus near misses, the
example's recipe; `policy`: the policy's wrong answers only, `python -m verl.demos.rlhf --no-near-misses`);
overrides go to every run. `--write-docs` replaces this command's row on this CPU in docs/demos.md
(benchmarks/doc_table.py).

The accuracy is the true one (numeric_match on the held-out problems, `reward.val_functions`); "RM reward" is
the reward model's mean score of the same greedy held-out answers (`val/training_reward`), "wrong answers the
RM prefers" counts, in the last validation, held-out answers that are wrong although the reward model scores
them above the correct answer (a policy that pleases its reward model without being right), and "off by ten"
the wrong held-out answers exactly 10 from the sum (a wrong tens digit), before and after GRPO.
The bar (issue 31): at least +20 points held-out with the example's recipe (its KL term, all negatives) on every
seed, each run under 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from ab import cpu_model, load_average

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rlhf_pipeline.yaml"
MIN_GAIN_PTS, MAX_SECONDS = 20.0, 300.0


def validations(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "val/accuracy" in r]


def preferred_wrong(run_dir: Path) -> tuple[int, int]:
    """(wrong held-out answers the reward model scores above the correct answer, answers checked) in the last
    validation; the correct answer's score is the reward model's, on the same prompt."""
    from verl.models.reward_model import RewardModelScorer

    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    last = max(s["step"] for s in samples)
    samples = [s for s in samples if s["step"] == last]
    summary = json.loads((run_dir / "summary.json").read_text())
    scorer = RewardModelScorer(summary["reward_model"])
    truth = scorer([s["prompt"] + s["ground_truth"] for s in samples]).tolist()
    wrong = [s["reward_extras"]["training_reward"] > t for s, t in zip(samples, truth, strict=True) if s["score"] == 0]
    return sum(wrong), len(samples)


def off_by_ten(run_dir: Path) -> tuple[int, int]:
    """Wrong held-out answers exactly 10 away from the sum, in the first and in the last validation."""
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]

    def count(step: int) -> int:
        return sum(s["score"] == 0 and s["response"].strip().isdigit()
                   and abs(int(s["response"]) - int(s["ground_truth"])) == 10 for s in samples if s["step"] == step)

    steps = [s["step"] for s in samples]
    return count(min(steps)), count(max(steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--kl", type=float, nargs="+", default=None, help="actor.kl_loss_coef values to run")
    parser.add_argument("--negatives", nargs="+", choices=("all", "policy"), default=["all"])
    parser.add_argument("--run-root", default="runs/rlhf_seeds")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = []
    for negatives in args.negatives:
        for kl in args.kl or [None]:
            for seed in args.seeds:
                name = f"seed{seed}" + ("" if kl is None else f"-kl{kl:g}") + ("" if negatives == "all" else "-policy")
                run_dir = Path(args.run_root).resolve() / name
                how = (["-m", "verl.cli.main", "train", str(EXAMPLE)] if negatives == "all" else
                       ["-m", "verl.demos.rlhf", str(EXAMPLE), "--no-near-misses"])
                cmd = [sys.executable, *how, f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
                       "trainer.resume=never", "trainer.log_samples=128",
                       *([] if kl is None else [f"actor.kl_loss_coef={kl}"]), *args.overrides]
                subprocess.run(cmd, check=True, cwd=ROOT)
                summary = json.loads((run_dir / "summary.json").read_text())
                val = validations(run_dir)
                rows.append((summary, negatives, val[0].get("val/training_reward"), val[-1].get("val/training_reward"),
                             preferred_wrong(run_dir), off_by_ten(run_dir), load_average()))
    print(f"{cpu_model()}, {datetime.date.today()}, `python benchmarks/rlhf_seeds.py {' '.join(sys.argv[1:])}`")
    print("| seed | KL coef | RM negatives | accuracy after SFT | accuracy after GRPO | gain | RM held-out pair "
          "accuracy | RM reward of held-out answers (before -> after) | wrong answers the RM prefers | off by ten "
          "(before -> after) | wall time | load (1/5/15 min, at the end) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s, negatives, before, after, (wrong, checked), (ten0, ten1), load in rows:
        print(f"| {s['seed']} | {s['kl_loss_coef']:g} | {negatives} | {s['accuracy_after_sft']:.1%} | "
              f"{s['accuracy_after_rl']:.1%} | {s['accuracy_gain'] * 100:+.1f} pts | {s['rm_pair_accuracy']:.1%} | "
              f"{before:+.2f} -> {after:+.2f} | {wrong}/{checked} | {ten0} -> {ten1} | {s['wall_seconds']:.0f} s | "
              f"{load} |")
    recipe = [s for s, negatives, *_ in rows if s["kl_loss_coef"] > 0 and negatives == "all"]
    cleared = sum(100 * s["accuracy_gain"] >= MIN_GAIN_PTS and s["wall_seconds"] < MAX_SECONDS for s in recipe)
    if recipe:  # the bar is the example's recipe's; other variants are there to be compared with it
        print(f"\nseeds clearing the bar with the example's recipe (>= +{MIN_GAIN_PTS:.0f} pts in under "
              f"{MAX_SECONDS:.0f} s): {cleared}/{len(recipe)}")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.table_and("seeds clearing"),
                                   doc=doc_table.ROOT / "docs" / "demos.md"))
