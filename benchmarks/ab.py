"""Interleaved A/B timing shared by the benchmarks: each round times the baseline and the candidate back to
back (alternating which goes first), so a load burst on a shared machine hits both sides of a round alike;
the per-round ratios give a median and a min–max spread."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def load_average() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def add_cpu_matmul_argument(parser: argparse.ArgumentParser) -> None:
    """`--cpu-matmul`: verl's `trainer.cpu_matmul` for a benchmark's verl side (the baseline keeps MKL)."""
    parser.add_argument("--cpu-matmul", default="auto", choices=["auto", "aten", "onednn"],
                        help="verl's trainer.cpu_matmul (auto: oneDNN on AMD processors, ATen elsewhere)")


def interleaved_times(sides: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each side in each round; every round runs all sides back to back, starting one later
    than the round before, so no side always goes first (or always follows the same one)."""
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratios(base_s: list[float], cand_s: list[float]) -> dict[str, float | list[float]]:
    """Per-round ratios baseline/candidate (> 1: the candidate is faster): median, min, max, and the medians
    of the times."""
    per_round = [b / c for b, c in zip(base_s, cand_s, strict=True)]
    return {"baseline_s": statistics.median(base_s), "candidate_s": statistics.median(cand_s),
            "ratio": statistics.median(per_round), "ratio_min": min(per_round), "ratio_max": max(per_round),
            "ratios": per_round}


def interleaved(baseline: Callable[[], object], candidate: Callable[[], object], rounds: int,
                warmup: int = 1) -> dict[str, float | list[float]]:
    """Seconds of each side per round and the ratio baseline/candidate (> 1: the candidate is faster)."""
    times = interleaved_times({"baseline": baseline, "candidate": candidate}, rounds, warmup)
    return ratios(times["baseline"], times["candidate"])


def ratio_line(name: str, result: dict, baseline: str) -> str:
    return (f"ratio {name} vs {baseline}: median {result['ratio']:.2f}x "
            f"(min {result['ratio_min']:.2f}x, max {result['ratio_max']:.2f}x over {len(result['ratios'])} rounds; "
            f"{baseline} {result['baseline_s']:.3f}s, {name} {result['candidate_s']:.3f}s per round median; "
            f"load average {load_average()})")
