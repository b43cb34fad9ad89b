"""`verl view` on a large run: 10k logged steps and a ~1 GB rollouts.jsonl, against reading the files whole.

`python benchmarks/view_scale.py [--steps 10000] [--rollouts-mb 1024] [--dir DIR] [--write-docs]` writes a
synthetic run folder (metrics.jsonl with 60 metrics per step, rollouts.jsonl with ~2 KB rows: prompt, response,
reward parts, an episode every fourth row), then times what the live page asks of the server through the same
API (`verl.view.runs.Runs.answer`):

- the first index of the rollouts (as many polls as it takes; a poll reads at most its byte budget),
- a poll after one more step's rows are appended (the page's refresh while a run writes),
- a page of one step's rows, a page sorted by reward over every step, a text search, the metrics since step 0;

and the baseline, what a viewer without an index does on every refresh: parse the whole rollouts.jsonl
(`json.loads` per line). It prints the peak RSS of each (a fresh process each, getrusage) and ratio lines:
the baseline's time over the poll's and over the step page's. The folder is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "observability.md"
ROWS_PER_STEP = 64
WORDS = "the model adds the tens and then the units so the answer to this sum is what comes next".split()


def write_run(folder: Path, steps: int, rollouts_mb: int) -> tuple[int, int]:
    """metrics.jsonl of `steps` rows; rollouts.jsonl of about `rollouts_mb` MB over those steps."""
    rng = random.Random(0)
    with open(folder / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step in range(1, steps + 1):
            row = {"step": step} | {f"{g}/m{i}": rng.random() for g in ("reward", "actor", "timing") for i in range(20)}
            f.write(json.dumps(row) + "\n")
    size, rows, step = rollouts_mb << 20, 0, 1
    with open(folder / "rollouts.jsonl", "w", encoding="utf-8") as f:
        while f.tell() < size:
            text = " ".join(rng.choice(WORDS) for _ in range(300))
            episode = None if rows % 4 else {"status": "ok", "error": None, "turns": [
                {"role": "assistant", "text": text[:400], "trained": True, "reward": None, "error": None},
                {"role": "tool", "text": text[400:800], "trained": False, "reward": None, "error": None}]}
            row = {"step": step, "sample": rows % ROWS_PER_STEP, "group": str(rows % 16),
                   "prompt": f"{rows}: {text[:200]}", "response": text, "data_source": ("math", "code")[rows % 2],
                   "ground_truth": str(rows % 100),
                   "reward": rng.random(), "rewards": {"match": rng.random(), "format": rng.random()},
                   "advantage": rng.gauss(0, 1), "response_length": 300, "episode": episode}
            f.write(json.dumps(row) + "\n")
            rows += 1
            step += rows % ROWS_PER_STEP == 0
    return rows, step


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def child(folder: str, what: str) -> None:
    """One measurement in this fresh process; prints seconds and peak RSS (MB) as JSON."""
    path = Path(folder)
    if what == "baseline":
        seconds, rows = timed(lambda: [json.loads(line) for line in open(path / "rollouts.jsonl", encoding="utf-8")])
        out = {"seconds": seconds, "rows": len(rows)}
    else:
        from verl.view.runs import Run, Runs

        runs = Runs([Run(0, path, "scale")])
        rows = runs.runs[0].rows["rollouts"]
        first = 0.0
        while True:  # the first index: a poll reads at most its byte budget, so a big file takes several
            seconds, _ = timed(rows.refresh)
            first += seconds
            if rows.tail.offset >= (path / "rollouts.jsonl").stat().st_size:
                break
        last = max(rows.by_step)
        with open(path / "rollouts.jsonl", "a", encoding="utf-8") as f:  # the run writes one more step
            for i in range(ROWS_PER_STEP):
                f.write(json.dumps({"step": last + 1, "sample": i, "prompt": "new", "response": "rows",
                                    "reward": 1.0, "advantage": 0.0}) + "\n")
        poll, _ = timed(lambda: runs.answer("steps", {"source": "rollouts"}))
        page, answer = timed(lambda: runs.answer("rows", {"source": "rollouts", "step": str(last // 2)}))
        assert answer["rows"], "a step's page came back empty"
        sort, _ = timed(lambda: runs.answer("rows", {"source": "rollouts", "sort": "reward", "desc": "1"}))
        search, _ = timed(lambda: runs.answer("rows", {"source": "rollouts", "q": "no such words here"}))
        metrics, answer = timed(lambda: runs.answer("metrics", {"since": "0"}))
        out = {"first_index": first, "poll": poll, "step_page": page, "sorted_page": sort, "search_page": search,
               "metrics": metrics, "metric_rows": len(answer.get("rows", []))}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def measure(folder: Path, what: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", str(folder), what], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--rollouts-mb", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where the synthetic run goes (a temporary folder)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="view_scale_", dir=args.dir))
    try:
        free_mb = shutil.disk_usage(base).free >> 20
        if free_mb < 2 * args.rollouts_mb:
            raise SystemExit(f"{base}: {free_mb} MB free, the run needs about {2 * args.rollouts_mb}; lower "
                             "--rollouts-mb or choose --dir")
        rows, steps = write_run(base, args.steps, args.rollouts_mb)
        size = (base / "rollouts.jsonl").stat().st_size >> 20
        ours, baseline = measure(base, "view"), measure(base, "baseline")
        print(f"run: {args.steps} metric rows, rollouts.jsonl {size} MB ({rows} rows over {steps} steps)")
        print(f"verl view: first index {ours['first_index']:.1f} s, poll after one step {ours['poll'] * 1e3:.1f} ms, "
              f"a step's page {ours['step_page'] * 1e3:.1f} ms, sorted by reward {ours['sorted_page'] * 1e3:.0f} ms, "
              f"a text search's page {ours['search_page'] * 1e3:.0f} ms, metrics {ours['metrics'] * 1e3:.0f} ms "
              f"({ours['metric_rows']} rows), peak RSS {ours['peak_rss_mb']:.0f} MB")
        print(f"baseline (parse the whole file): {baseline['seconds']:.1f} s, "
              f"peak RSS {baseline['peak_rss_mb']:.0f} MB")
        print(f"ratio baseline / poll after one step: {baseline['seconds'] / ours['poll']:.0f}x")
        print(f"ratio baseline / a step's page: {baseline['seconds'] / ours['step_page']:.0f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        raise SystemExit(0)
    raise SystemExit(doc_table.run(main, doc=DOC, pick=doc_table.prefixed("run:", "verl view:", "baseline", "ratio")))
