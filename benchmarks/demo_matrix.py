"""Every built-in demo on several seeds under both CPU matmul kernels: the grid that says a recipe holds on any
CPU, not on the one it was tuned on.

`python benchmarks/demo_matrix.py [--demos arithmetic tool agent code rlhf] [--seeds 1 2 3]
[--kernels aten onednn] [--jobs 1] [--write-docs] [key=value ...]` runs each (demo, seed, kernel) as its own
`verl train` with `trainer.cpu_matmul=KERNEL` (overrides go to every run), prints one row per run and whether it
clears its demo's documented bar (and how many of its steps had a reward call, sandboxed program or agent episode
time out), and exits 1 if any run does not. `--write-docs` puts each row into the table in
docs/demos.md, replacing the row of the same (demo, seed, kernel, CPU), so subsets run at different times fill
one table. `--jobs 2` runs two at once (each on one torch thread): the wall times then include the other's load,
which the row's load average shows.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import load_average  # noqa: E402
from doc_table import cpu_label  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "demos.md"
BEGIN, END = "<!-- demo-matrix:begin -->", "<!-- demo-matrix:end -->"
HEADER = ["| demo | seed | kernel | CPU | date | after warm start | after RL | gain | bar | clears | wall time | "
          "load (1/5/15 min, at the end) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]


@dataclass(frozen=True)
class Demo:
    config: str | None  # the example config; None = `verl train` with no config (the built-in demo)
    min_gain_pts: float
    max_seconds: float
    min_after: float = 0.0  # accuracy after RL the bar also asks for


# The bars docs/demos.md documents for each demo (and the *_seeds.py scripts check).
DEMOS = {
    "arithmetic": Demo(None, 25.0, 180.0, min_after=0.65),
    "tool": Demo("examples/tool_calculator.yaml", 30.0, 300.0),
    "agent": Demo("examples/agent_tools.yaml", 30.0, 480.0),  # 80 GRPO steps of ~3.5 s: 512 OpenAI-client calls each
    "code": Demo("examples/code_expression.yaml", 25.0, 300.0),
    "rlhf": Demo("examples/rlhf_pipeline.yaml", 20.0, 300.0),
    "vision": Demo("examples/vision_shapes.yaml", 25.0, 300.0),
}


def bar_text(demo: Demo) -> str:
    after = f", >= {demo.min_after:.0%} after" if demo.min_after else ""
    return f">= +{demo.min_gain_pts:.0f} pts{after}, < {demo.max_seconds:.0f} s"


def clears(demo: Demo, summary: dict[str, Any]) -> bool:
    return (100 * summary["accuracy_gain"] >= demo.min_gain_pts and summary["accuracy_after_rl"] >= demo.min_after
            and summary["wall_seconds"] < demo.max_seconds)


def run_one(name: str, seed: int, kernel: str, run_root: Path, overrides: list[str]) -> dict[str, Any]:
    """One `verl train` of `name`; its summary.json plus the load average at its end, or the failure's tail."""
    demo = DEMOS[name]
    run_dir = run_root / f"{name}-seed{seed}-{kernel}"
    cmd = [sys.executable, "-m", "verl.cli.main", "train", *([str(ROOT / demo.config)] if demo.config else []),
           f"trainer.seed={seed}", f"trainer.cpu_matmul={kernel}", f"trainer.run_dir={run_dir}",
           "trainer.resume=never", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("VERL_CPU_MATMUL", None)  # the row's kernel is the one named on the command line
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    result = {"demo": name, "seed": seed, "kernel": kernel, "load": load_average(),
              "seconds": time.perf_counter() - start, "log": log.name}
    if proc.returncode == 0 and (run_dir / "summary.json").exists():
        result["summary"] = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    else:
        result["error"] = f"exit code {proc.returncode}; see {log.name}"
    return result


def timeout_steps(run_dir: Path) -> int:
    """Logged steps of a run (every stage's metrics.jsonl under it) where anything timed out: a reward call, a
    sandboxed program, an agent episode. On a loaded machine a limit too tight turns into zero rewards, so the
    row says how often it happened."""
    steps = 0
    for path in run_dir.rglob("metrics.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            metrics = json.loads(line) if line.strip() else {}
            steps += any("timeout" in key and value for key, value in metrics.items())
    return steps


def row(result: dict[str, Any], cpu: str, date: str) -> str:
    demo = DEMOS[result["demo"]]
    cells = [result["demo"], str(result["seed"]), result["kernel"], cpu, date]
    summary = result.get("summary")
    if summary is None:
        cells += ["", "", "", bar_text(demo), f"no: {result['error']}", f"{result['seconds']:.0f} s", result["load"]]
    else:
        timeouts = timeout_steps(Path(summary["run_dir"]))
        verdict = (("yes" if clears(demo, summary) else "no")
                   + (f" ({timeouts} steps with a timeout)" if timeouts else ""))
        cells += [f"{summary['accuracy_after_sft']:.1%}", f"{summary['accuracy_after_rl']:.1%}",
                  f"{100 * summary['accuracy_gain']:+.1f} pts", bar_text(demo), verdict,
                  f"{summary['wall_seconds']:.0f} s", result["load"]]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _key(line: str) -> tuple[str, ...]:
    cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
    return tuple(cells[:4])  # demo, seed, kernel, CPU


def write_rows(rows: list[str], doc: Path = DOC) -> None:
    """Upsert `rows` into the table between BEGIN and END in `doc`, sorted by (demo, seed, kernel, CPU); under a
    lock, so that two grids run side by side keep each other's rows."""
    with open(Path(tempfile.gettempdir()) / "verl-demo-matrix.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _upsert(rows, doc)


def _upsert(rows: list[str], doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"{doc} must contain one '{BEGIN}' line and one '{END}' line where the matrix goes")
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    kept = [line for line in block.strip().splitlines() if line.startswith("|") and line not in HEADER]
    new_keys = {_key(r) for r in rows}
    table = sorted([line for line in kept if _key(line) not in new_keys] + rows, key=_key)
    doc.write_text(f"{head}{BEGIN}\n" + "\n".join(HEADER + table) + f"\n{END}{tail}", encoding="utf-8")
    print(f"wrote {len(rows)} row(s) into {doc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demos", nargs="+", choices=sorted(DEMOS), default=list(DEMOS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--kernels", nargs="+", choices=["aten", "onednn"], default=["aten", "onednn"])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each on one torch thread)")
    parser.add_argument("--run-root", default="runs/demo_matrix")
    parser.add_argument("--write-docs", action="store_true", help=f"upsert the rows into {DOC.relative_to(ROOT)}")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    grid = [(d, s, k) for d in args.demos for s in args.seeds for k in args.kernels]
    run_root = Path(args.run_root).resolve()
    cpu, date = cpu_label(), datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    print(f"{cpu}, {date}: {len(grid)} runs, {args.jobs} at a time; logs in {run_root}", flush=True)
    rows, failed = [], 0
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = [pool.submit(run_one, *cell, run_root, args.overrides) for cell in grid]
        print("\n".join(HEADER), flush=True)
        for future in futures:
            result = future.result()
            rows.append(row(result, cpu, date))
            summary = result.get("summary")
            failed += summary is None or not clears(DEMOS[result["demo"]], summary)
            print(rows[-1], flush=True)
            if args.write_docs:  # each row as it lands: a long grid stopped halfway keeps what it ran
                write_rows(rows[-1:])
    print(f"\nruns clearing their demo's bar: {len(rows) - failed}/{len(rows)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
