"""Peak memory of `verl data normalize` on a big JSONL file, against loading the rows into a list.

Run by hand (not a test):  python benchmarks/data_normalize.py --size-mb 1024
The target is a peak RSS under 500 MB for a 1 GB file: normalize streams one row at a time, so its
memory should not grow with the file. The baseline is what a naive checker does -- `json.loads` every
line into a list -- measured on a smaller file (--baseline-mb) and scaled linearly to --size-mb.
Each measurement runs in its own wrapper process, so RUSAGE_CHILDREN sees only that command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Runs a command as its child and prints the child's peak RSS (KiB on Linux) on the last line.
_WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
    "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)
_BASELINE = "import json, sys\nrows = [json.loads(line) for line in open(sys.argv[1], encoding='utf-8')]\n"
_IDLE = "import json\n"


def make_jsonl(path: Path, size_mb: int) -> int:
    """Write SFT-style rows (with spreadsheet-style keys and a few bad rows) until size_mb; returns rows."""
    target = size_mb * 1024 * 1024
    words = "the quick brown fox jumps over a lazy dog while reasoning step by step about arithmetic".split()
    n = written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            q = " ".join(words[(n + i) % len(words)] for i in range(40 + n % 60))
            row = {
                "Question ": f"{n}: {q}?",
                "answer": f"{q[::-1]} é {n}",
                "meta": {"id": n, "tags": ["x", "y"]},
            }
            if n % 1000 == 999:
                row["answer"] = None  # a bad row now and then, so the report has something to hold
            line = json.dumps(row, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            n += 1
    return n


def peak_rss_mb(cmd: list[str]) -> tuple[int, float, float]:
    """(exit code, peak RSS in MB, seconds) of cmd."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], capture_output=True, text=True, check=True)
    rc, kib = out.stdout.split()[-2:]
    return int(rc), int(kib) / 1024, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="size of the generated JSONL (default 1024)")
    ap.add_argument("--baseline-mb", type=int, default=50, help="size used for the json.load baseline")
    ap.add_argument("--via-verl", action="store_true", help="run the `verl` console script instead of -m")
    ap.add_argument("--dir", default=None, help="where to put the temporary files")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        big, small, out = Path(d) / "big.jsonl", Path(d) / "small.jsonl", Path(d) / "out.jsonl"
        t0 = time.perf_counter()
        n_rows = make_jsonl(big, args.size_mb)
        make_jsonl(small, min(args.baseline_mb, args.size_mb))
        print(f"generated {args.size_mb} MB ({n_rows} rows) in {time.perf_counter() - t0:.0f} s")

        verl_cmd = ["verl"] if args.via_verl else [sys.executable, "-m", "verl.cli.data_cmd"]
        rc, verl_mb, verl_s = peak_rss_mb(
            [*verl_cmd, "data", "normalize", str(big), str(out), "--kind", "sft"]
        )
        if rc not in (0, 1):
            print(f"verl data normalize failed with exit code {rc}", file=sys.stderr)
            return 1
        report = json.loads(Path(str(out) + ".report.json").read_text())
        _, idle_mb, _ = peak_rss_mb([sys.executable, "-c", _IDLE])
        _, base_small_mb, _ = peak_rss_mb([sys.executable, "-c", _BASELINE, str(small)])
        small_mb = small.stat().st_size / 2**20
        base_mb = idle_mb + (base_small_mb - idle_mb) * (big.stat().st_size / 2**20) / small_mb
        out_mb = os.path.getsize(out) / 2**20

    print(f"{'what':<44} {'peak RSS MB':>12} {'seconds':>8}")
    print(f"{'verl data normalize ' + str(args.size_mb) + ' MB':<44} {verl_mb:>12.0f} {verl_s:>8.1f}")
    print(f"{'python + import json (floor)':<44} {idle_mb:>12.0f}")
    print(f"{'json.loads all rows, ' + f'{small_mb:.0f} MB measured':<44} {base_small_mb:>12.0f}")
    print(f"{'json.loads all rows, scaled to ' + str(args.size_mb) + ' MB':<44} {base_mb:>12.0f}")
    print(
        f"rows read {report['total_rows']}, kept {report['kept_rows']}, dropped {report['dropped_rows']}; "
        f"output {out_mb:.0f} MB; throughput {args.size_mb / verl_s:.0f} MB/s"
    )
    print(f"target: peak < 500 MB -> {'OK' if verl_mb < 500 else 'OVER'}")
    print(f"ratio: baseline / verl peak RSS = {base_mb / verl_mb:.1f}x")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(
        doc_table.run(main, doc_table.prefixed("verl data normalize", "ratio"), doc=doc_table.ROOT / "docs" / "data.md")
    )
