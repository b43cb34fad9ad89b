"""Run the code demo (`verl train examples/code_expression.yaml`: answers are Python expressions, scored by running
them in verl.sandbox) on several seeds, one after the other, and print a table of the results.

`python benchmarks/code_demo_seeds.py [--seeds 1 2 3] [key=value ...] [--write-docs]` (overrides go to every run);
`--write-docs` replaces this command's row on this CPU in docs/demos.md (benchmarks/doc_table.py).
The bar (issue 30): at least +25 points held-out on every seed, each run under 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from ab import cpu_model
from verl_runs import example_summaries

ROOT = Path(__file__).resolve().parents[1]
MIN_GAIN_PTS, MAX_SECONDS = 25.0, 300.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--run-root", default="runs/code_demo_seeds")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    runs = example_summaries(ROOT / "examples" / "code_expression.yaml", args.seeds, args.run_root, args.overrides)
    print(f"{cpu_model()}, {datetime.date.today()}, `python benchmarks/code_demo_seeds.py {' '.join(sys.argv[1:])}`")
    print("| seed | accuracy after SFT | accuracy after GRPO | gain | time in reward | SFT steps | wall time | "
          "load (1/5/15 min, at the end) |")
    print("|---|---|---|---|---|---|---|---|")
    for s, load in runs:
        reward_s = s.get("seconds_per_stage", {}).get("reward")
        print(f"| {s['seed']} | {s['accuracy_after_sft']:.1%} | {s['accuracy_after_rl']:.1%} | "
              f"{s['accuracy_gain'] * 100:+.1f} pts | {'' if reward_s is None else f'{reward_s:.0f} s'} | "
              f"{s['sft_steps']} | {s['wall_seconds']:.0f} s | {load} |")
    cleared = sum(100 * s["accuracy_gain"] >= MIN_GAIN_PTS and s["wall_seconds"] < MAX_SECONDS for s, _ in runs)
    print(f"\nseeds clearing the bar (>= +{MIN_GAIN_PTS:.0f} pts in under {MAX_SECONDS:.0f} s): {cleared}/{len(runs)}")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(
        doc_table.run(main, doc_table.table_and("seeds clearing"), doc=doc_table.ROOT / "docs" / "demos.md")
    )
