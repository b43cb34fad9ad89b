"""Screenshots of `verl view` for docs/observability.md, from real short runs of the built-in demos.

Three runs, one after the other, in a scratch folder: the arithmetic demo at two seeds (their metrics overlaid)
and the tool-use demo (multi-turn episodes: model turns and calculator results). `verl view --out` writes the
report; headless Chromium opens each view by its URL hash and saves a PNG to docs/images/view-<view>.png.
Run by hand: ``python benchmarks/view_screenshots.py [--steps 20] [--keep DIR]`` (Chromium on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def train(run_dir: Path, steps: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "verl.cli.main", "train", *args, f"trainer.total_steps={steps}",
           f"trainer.run_dir={run_dir}"]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def screenshot(browser: str, url: str, out: Path, size: str) -> None:
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--virtual-time-budget=10000", f"--window-size={size}", f"--screenshot={out}", url],
                   check=True, capture_output=True, timeout=120)


def first_tokens_id(run_dir: Path, step: int) -> int:
    """The first response of `step` that has a tool result (masked tokens), else the step's first."""
    rows = [json.loads(line) for line in (run_dir / "tokens.jsonl").read_text().splitlines()]
    ids = [i for i, r in enumerate(rows) if r["step"] == step]
    return next((i for i in ids if any(rows[i]["masked"])), ids[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per run (default 20)")
    parser.add_argument("--keep", default=None, help="run the demos in this folder and keep it")
    parser.add_argument("--size", default="1200,800", help="browser window (default 1200,800)")
    args = parser.parse_args()
    browser = next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        sys.exit("no chromium on PATH (Debian: apt-get install chromium)")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="verl-view-shots-"))
    runs = [work / "demo-seed42", work / "demo-seed1", work / "tool-calculator"]
    if not all((r / "metrics.jsonl").is_file() for r in runs):
        train(runs[0], args.steps)
        train(runs[1], args.steps, "trainer.seed=1")
        train(runs[2], args.steps, str(ROOT / "examples" / "tool_calculator.yaml"))
    report = work / "report.html"
    subprocess.run([sys.executable, "-m", "verl.cli.main", "view", *map(str, runs), "--out", str(report)], check=True)
    token_id = first_tokens_id(runs[2], args.steps)
    views = {"metrics": "#metrics?filter=reward", "samples": "#samples?run=0&source=rollouts&sort=advantage&desc=1",
             "episodes": "#episodes?run=2", "tokens": f"#tokens?run=2&step={args.steps}&id={token_id}&value=logprob"}
    IMAGES.mkdir(parents=True, exist_ok=True)
    for view, fragment in views.items():
        out = IMAGES / f"view-{view}.png"
        screenshot(browser, report.as_uri() + fragment, out, args.size)
        print(f"{out.relative_to(ROOT)}: {out.stat().st_size // 1024} KiB  ({fragment})")
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
