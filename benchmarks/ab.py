"""Interleaved A/B timing shared by the benchmarks: each round times the baseline and the candidate back to
back (alternating which goes first), so a load burst on a shared machine hits both sides of a round alike;
the per-round ratios give a median and a min–max spread."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def load_average() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def interleaved(baseline: Callable[[], object], candidate: Callable[[], object], rounds: int,
                warmup: int = 1) -> dict[str, float | list[float]]:
    """Seconds of each side per round and the ratio baseline/candidate (> 1: the candidate is faster)."""
    for _ in range(warmup):
        baseline()
        candidate()
    base_s, cand_s = [], []
    for r in range(rounds):
        order = [(baseline, base_s), (candidate, cand_s)]
        for fn, out in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ratios = [b / c for b, c in zip(base_s, cand_s, strict=True)]
    return {"baseline_s": statistics.median(base_s), "candidate_s": statistics.median(cand_s),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratios": ratios}


def ratio_line(name: str, result: dict, baseline: str) -> str:
    return (f"ratio {name} vs {baseline}: median {result['ratio']:.2f}x "
            f"(min {result['ratio_min']:.2f}x, max {result['ratio_max']:.2f}x over {len(result['ratios'])} rounds; "
            f"{baseline} {result['baseline_s']:.3f}s, {name} {result['candidate_s']:.3f}s per round median; "
            f"load average {load_average()})")
