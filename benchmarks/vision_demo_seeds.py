"""Run the vision demo (`verl train examples/vision_shapes.yaml`: a tiny vision-language model counts coloured
squares in pictures) on several seeds under each CPU matmul kernel, one run after the other, and print its rows.

`python benchmarks/vision_demo_seeds.py [--seeds 1 2 3] [--kernels aten onednn] [--matrix] [key=value ...]
[--write-docs]` (overrides go to every run); `--write-docs` replaces this command's row on this CPU in
docs/demos.md (benchmarks/doc_table.py); `--matrix` also upserts each run's row into the demo matrix there
(benchmarks/demo_matrix.py, whose `run_one` runs each seed here). The bar (issue 50): at least +25 points held-out
on every seed under both kernels, each run under 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from demo_matrix import DEMOS, HEADER, clears, row, run_one, write_rows
from doc_table import cpu_label


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--kernels", nargs="+", choices=["aten", "onednn"], default=["aten", "onednn"])
    parser.add_argument("--run-root", default="runs/vision_demo_seeds")
    parser.add_argument("--matrix", action="store_true", help="upsert each run's row into docs/demos.md's matrix")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    run_root = Path(args.run_root).resolve()
    cpu, date = cpu_label(), datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    print("\n".join(HEADER), flush=True)
    results = []
    for seed in args.seeds:
        for kernel in args.kernels:
            result = run_one("vision", seed, kernel, run_root, args.overrides)
            results.append(result)
            line = row(result, cpu, date)
            print(line, flush=True)
            if args.matrix:
                write_rows([line])
    demo = DEMOS["vision"]
    done = [r["summary"] for r in results if "summary" in r]
    for r in results:
        s = r.get("summary")
        print(f"seed {r['seed']} {r['kernel']}: " + (
            f"{s['accuracy_after_sft']:.1%} -> {s['accuracy_after_rl']:.1%} ({100 * s['accuracy_gain']:+.1f} pts), "
            f"{s['sft_steps']} SFT steps, {s['wall_seconds']:.0f} s" if s else f"failed: {r['error']}"))
    cleared = sum(clears(demo, s) for s in done)
    print(f"\nruns clearing the bar (>= +{demo.min_gain_pts:.0f} pts in under {demo.max_seconds:.0f} s): "
          f"{cleared}/{len(results)}" + (f"; smallest gain {min(100 * s['accuracy_gain'] for s in done):+.1f} pts, "
                                         f"slowest {max(s['wall_seconds'] for s in done):.0f} s" if done else ""))
    return 0 if cleared == len(results) else 1


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.prefixed("seed ", "runs clearing"),
                                   doc=doc_table.ROOT / "docs" / "demos.md"))
