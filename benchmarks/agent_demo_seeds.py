"""Run the agent demo (`verl train examples/agent_tools.yaml`) on several seeds, one after the other, and print a
table of the results.

`python benchmarks/agent_demo_seeds.py [--seeds 1 2 3] [key=value ...] [--write-docs]` (overrides go to every
run); `--write-docs` replaces this command's row on this CPU in docs/demos.md (benchmarks/doc_table.py).
The bar (issue 29, then): at least +30 points held-out on every seed, each run under 5 minutes on 2 cores;
benchmarks/demo_matrix.py holds today's (DEMOS['agent']).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from ab import cpu_model
from verl_runs import example_summaries

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--run-root", default="runs/agent_tools_seeds")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    runs = example_summaries(ROOT / "examples" / "agent_tools.yaml", args.seeds, args.run_root, args.overrides)
    print(f"{cpu_model()}, {datetime.date.today()}, `python benchmarks/agent_demo_seeds.py {' '.join(sys.argv[1:])}`")
    print("| seed | accuracy after SFT | accuracy after GRPO | gain | endpoint calls per episode after GRPO | "
          "SFT steps | wall time | load (1/5/15 min, at the end) |")
    print("|---|---|---|---|---|---|---|---|")
    for s, load in runs:
        print(f"| {s['seed']} | {s['accuracy_after_sft']:.1%} | {s['accuracy_after_rl']:.1%} | "
              f"{(s['accuracy_after_rl'] - s['accuracy_after_sft']) * 100:+.1f} pts | "
              f"{s['calls_per_episode_after_rl']:.2f} | {s['sft_steps']} | {s['wall_seconds']:.0f} s | {load} |")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.table_and(), doc=doc_table.ROOT / "docs" / "demos.md"))
