"""The speed targets on this host in one command (`make bench`): each target's benchmark, its figure, met or not.

The targets (issue 47) are rows of docs/performance.md and docs/demos.md: GRPO vs TRL on the tiny and the 10M
model, DPO vs TRL, and `make run` (the demo's slowest of four seeds). Each runs as its own script with the
command line its row records, so with `--write-docs` it replaces this CPU's row of that table (a host that has
none gets its rows); the figure is read from the script's own summary line, and this script's row (one per
CPU) lists every target's figure against its goal. TRL 1.16 is installed apart from verl's environment on first
use (`--trl-path`, default `$VERL_CACHE_DIR/trl-1.16.0`, `~/.cache/verl` by default: docs/performance.md says
why). The machine should be quiet: each script prints the load average it ran under.

Run by hand (10-30 min on 2 cores): ``python benchmarks/targets.py [--only grpo-tiny,dpo] [--write-docs]``
or ``make bench BENCH_ARGS=--write-docs``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_VERSION = "1.16.0"
# Outside the checkout, so that rows show it as the TRL_PATH placeholder, as the other rows of these tables do.
DEFAULT_TRL_PATH = Path(os.environ.get("VERL_CACHE_DIR") or Path.home() / ".cache" / "verl") / f"trl-{TRL_VERSION}"
# What TRL needs beside verl's environment (installed with --no-deps, so that TRL's own torch pin is not).
TRL_PACKAGES = (f"trl=={TRL_VERSION}", "datasets", "dill", "multiprocess", "xxhash", "pandas", "python-dateutil",
                "tzdata")
TRL = "{trl}"  # where a target's arguments take --trl-path


@dataclass(frozen=True)
class Target:
    """One goal: `script ARGS` prints `pattern` (group 1: the figure), which must be >= `at_least` or
    < `below`."""

    name: str
    what: str
    script: str
    args: tuple[str, ...]
    pattern: str
    at_least: float | None = None
    below: float | None = None
    unit: str = "x"
    decimals: int = 2  # as the script prints the figure

    def argv(self, trl_path: Path) -> list[str]:
        return [a.replace(TRL, str(trl_path)) for a in self.args]

    @property
    def needs_trl(self) -> bool:
        return TRL in self.args

    def figure(self, output: str) -> float | None:
        """The figure the script printed (its last match), or None when it printed none."""
        found = re.findall(self.pattern, output)
        return float(found[-1]) if found else None

    def met(self, figure: float) -> bool:
        return (self.at_least is None or figure >= self.at_least) and (self.below is None or figure < self.below)

    def goal(self) -> str:
        return f">= {self.at_least:g}{self.unit}" if self.at_least is not None else f"< {self.below:g}{self.unit}"

    def verdict(self, figure: float | None) -> str:
        """`what figure (goal): met` for this script's row."""
        if figure is None:
            return f"{self.what}: no figure ({self.goal()})"
        shown = f"{figure:.{self.decimals}f}{self.unit}"
        return f"{self.what} {shown} ({self.goal()}): {'met' if self.met(figure) else 'not met'}"


GRPO = r"ratio verl vs TRL GRPOTrainer \({}\): ([0-9.]+)x"
TARGETS = (
    Target("grpo-tiny", "GRPO vs TRL, tiny", "grpo_vs_trl.py",
           ("--trl-path", TRL, "--sizes", "tiny", "--rounds", "9", "--steps", "6"), GRPO.format("tiny"), at_least=3),
    Target("grpo-10m", "GRPO vs TRL, 10M", "grpo_vs_trl.py",
           ("--trl-path", TRL, "--sizes", "10m", "--rounds", "7", "--steps", "2"), GRPO.format("10m"), at_least=2),
    Target("dpo", "DPO vs TRL", "dpo.py", ("--trl-path", TRL), r"ratio verl/TRL steps/s: median ([0-9.]+)x",
           at_least=2),
    Target("make-run", "make run, slowest of 4 seeds", "demo_seeds.py", ("--seeds", "42", "1", "2", "3"),
           r"slowest ([0-9.]+) s", below=60, unit=" s", decimals=0),
)


def pick_verdicts(lines: list[str]) -> list[str]:
    """This script's row: the verdict lines, without their `target:` label."""
    return [line.removeprefix("target:").strip() for line in lines if line.startswith("target:")]


def pick(names: str | None) -> list[Target]:
    """The targets `--only` names (comma-separated), in their order; all without it."""
    if not names:
        return list(TARGETS)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {t.name for t in TARGETS}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise SystemExit(f"--only: unknown target(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    return [t for t in TARGETS if t.name in wanted]


def ensure_trl(path: Path) -> None:
    """TRL importable from `path`, installed there (no dependencies: verl's environment has them) if not."""
    probe = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import trl; print(trl.__version__)"]
    if subprocess.run([*probe, str(path)], capture_output=True, text=True).returncode == 0:
        return
    print(f"installing TRL {TRL_VERSION} into {path} (apart from verl's packages)", flush=True)
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(path), *TRL_PACKAGES]
    if subprocess.run(install).returncode != 0:
        raise SystemExit(f"could not install TRL into {path} (pip's error above). Fix: install it by hand, "
                         f"`{' '.join(install[2:])}`, or pass --trl-path to a folder that has TRL {TRL_VERSION}; "
                         "--only make-run needs no TRL")


def run_target(target: Target, trl_path: Path, write_docs: bool) -> tuple[float | None, int]:
    """Run the target's script (echoing its output); its figure and exit code."""
    command = [sys.executable, str(HERE / target.script), *target.argv(trl_path), *(["--write-docs"] * write_docs)]
    print(f"\n=== {target.what}: python benchmarks/{target.script} {' '.join(command[2:])}", flush=True)
    lines: list[str] = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    return target.figure("".join(lines)), proc.returncode


def main(argv: Sequence[str] | None = None, write_rows: bool = False) -> int:
    """Run the targets; `write_rows`: each script writes its row (this script's `--write-docs`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated targets: " + ", ".join(t.name for t in TARGETS))
    parser.add_argument("--trl-path", type=Path, default=DEFAULT_TRL_PATH,
                        help="where TRL is (installed there if it is not)")
    args = parser.parse_args(argv)
    targets = pick(args.only)
    if any(t.needs_trl for t in targets):
        ensure_trl(args.trl_path)
    verdicts, failed = [], []
    for target in targets:
        figure, code = run_target(target, args.trl_path, write_rows)
        verdicts.append(target.verdict(figure) + (f" (its script exited {code})" if code else ""))
        if figure is None:
            failed.append(target.name)
    print("\n" + "\n".join(f"target: {v}" for v in verdicts))
    if failed:
        print(f"no figure from: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    import doc_table

    # `--write-docs` writes this script's row and has every target's script write its own.
    write = "--write-docs" in sys.argv
    raise SystemExit(doc_table.run(lambda: main(write_rows=write), pick_verdicts))
