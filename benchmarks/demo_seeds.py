"""The built-in demo over several seeds: held-out accuracy before and after GRPO, gain and wall time.

Each seed is one `verl train` with no config (the demo), in its own process, one after the other, so the
times are what a user of `make run` sees on this machine (the warm start included). The table is printed;
with `--write-readme` it also replaces the block between the `demo-seeds` markers in README.md, captioned
with the command, this machine's CPU model, core count and the date, so the README says what was measured
where; with `--write-docs` the run's summary replaces this command's row on this CPU in docs/demos.md.
The bar each seed must clear (issue 12): at least +25 points held-out, at least 65% after RL, under 3 min.
Run by hand: ``python benchmarks/demo_seeds.py [--seeds 1 2 3 42] [--write-readme] [--write-docs] [key=value ...]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import cpu_model  # noqa: E402
from verl_runs import run_verl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- demo-seeds:begin -->", "<!-- demo-seeds:end -->"
MIN_GAIN_PTS, MIN_AFTER, MAX_SECONDS = 25.0, 0.65, 180.0
COLUMNS = ("seed", "warm-start SFT steps", "held-out after SFT", "after GRPO", "gain", "wall time")


def meets_bar(summary: dict[str, Any]) -> bool:
    return (100 * summary["accuracy_gain"] >= MIN_GAIN_PTS and summary["accuracy_after_rl"] >= MIN_AFTER
            and summary["wall_seconds"] < MAX_SECONDS)


def table_rows(summaries: list[dict[str, Any]], default_seed: int | None = 42) -> list[list[str]]:
    rows = []
    for s in summaries:
        seed = f"{s['seed']} (default)" if s["seed"] == default_seed else str(s["seed"])
        rows.append([seed, str(s["sft_steps"]), f"{s['accuracy_after_sft']:.1%}", f"{s['accuracy_after_rl']:.1%}",
                     f"{100 * s['accuracy_gain']:+.1f} pts", f"{s['wall_seconds']:.0f} s"])
    return rows


def markdown_table(summaries: list[dict[str, Any]], caption: str) -> str:
    lines = [caption, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summaries)]
    return "\n".join(lines)


def caption(summaries: list[dict[str, Any]], cores: int | None = None, today: datetime.date | None = None) -> str:
    cores = cores if cores is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                             else os.cpu_count())
    today = today or datetime.date.today()
    steps = sorted({s["steps"] for s in summaries})
    return (f"Written by `python benchmarks/demo_seeds.py --write-readme` on {cpu_model()} ({cores} cores), "
            f"{today.isoformat()}: "
            f"`verl train` with the default config, one seed per run, GRPO {'/'.join(map(str, steps))} steps; "
            "wall time includes building the model and the warm start.")


def replace_block(text: str, block: str, where: str = "README.md") -> str:
    """Swap what lies between the markers for `block`; the markers must each appear exactly once."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{where} must contain one '{BEGIN}' line followed by one '{END}' line around the "
                         "demo table; add them where the table goes.")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def run_seed(seed: int, run_root: Path, overrides: list[str]) -> dict[str, Any]:
    run_dir = run_root / f"seed-{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run each time: resume: auto would otherwise continue the old one
    run_verl("train", f"trainer.seed={seed}", f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]", *overrides,
             what=f"seed {seed}")
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2, 3])
    parser.add_argument("--run-root", type=Path, default=ROOT / "runs" / "demo-seeds")
    parser.add_argument("--write-readme", action="store_true", help="replace the demo table in README.md")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (the README is then "
                        "not the default config's: --write-readme refuses)")
    args = parser.parse_args(argv)
    if args.write_readme and args.overrides:
        parser.error("--write-readme records the default demo; drop the key=value overrides")

    summaries = []
    for seed in args.seeds:
        summary = run_seed(seed, args.run_root, args.overrides)
        summaries.append(summary)
        print(f"seed {seed}: {summary['accuracy_after_sft']:.1%} -> {summary['accuracy_after_rl']:.1%} "
              f"({100 * summary['accuracy_gain']:+.1f} pts) in {summary['wall_seconds']:.0f} s", flush=True)
    block = markdown_table(summaries, caption(summaries))
    print()
    print(block)
    passed = sum(meets_bar(s) for s in summaries)
    print(f"\nseeds clearing the bar (>= +{MIN_GAIN_PTS:.0f} pts, >= {MIN_AFTER:.0%} after RL, "
          f"< {MAX_SECONDS:.0f} s): {passed}/{len(summaries)}; smallest gain "
          f"{min(100 * s['accuracy_gain'] for s in summaries):+.1f} pts, lowest after RL "
          f"{min(s['accuracy_after_rl'] for s in summaries):.1%}, "
          f"slowest {max(s['wall_seconds'] for s in summaries):.0f} s")
    if args.write_readme:
        args.readme.write_text(replace_block(args.readme.read_text(encoding="utf-8"), block, str(args.readme)),
                               encoding="utf-8")
        print(f"wrote the table into {args.readme}")
    return 0 if passed == len(summaries) else 1


if __name__ == "__main__":
    import doc_table

    raise SystemExit(
        doc_table.run(main, doc_table.prefixed("seed ", "seeds clearing"), doc=doc_table.ROOT / "docs" / "demos.md")
    )
