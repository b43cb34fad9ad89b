"""benchmarks/demo_seeds.py: the table it prints and the README block it rewrites (no training here)."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("demo_seeds_bench", ROOT / "benchmarks" / "demo_seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(seed: int, before: float, after: float, seconds: float) -> dict:
    return {"seed": seed, "sft_steps": 400, "accuracy_after_sft": before, "accuracy_after_rl": after,
            "accuracy_gain": after - before, "wall_seconds": seconds, "steps": 200}


def test_table_reports_points_and_the_machine() -> None:
    bench = _module()
    runs = [_summary(42, 0.25, 0.8125, 121.4), _summary(1, 0.3125, 0.6484375, 99.6)]
    caption = bench.caption(runs, cores=2, today=datetime.date(2026, 11, 30))
    assert bench.cpu_model() in caption and "(2 cores), 2026-11-30" in caption and "GRPO 200 steps" in caption
    table = bench.markdown_table(runs, caption).splitlines()
    assert table[2] == "| seed | warm-start SFT steps | held-out after SFT | after GRPO | gain | wall time |"
    assert table[4] == "| 42 (default) | 400 | 25.0% | 81.2% | +56.2 pts | 121 s |"
    assert table[5] == "| 1 | 400 | 31.2% | 64.8% | +33.6 pts | 100 s |"
    assert bench.meets_bar(runs[0]) and not bench.meets_bar(runs[1])  # 64.8% is under the 65% bar
    assert not bench.meets_bar(_summary(2, 0.5, 0.7, 60.0))  # +20 pts is under the +25 bar
    assert not bench.meets_bar(_summary(3, 0.2, 0.9, 181.0))  # too slow


def test_replace_block_keeps_the_rest_of_the_readme() -> None:
    bench = _module()
    text = f"intro\n{bench.BEGIN}\nold table\n{bench.END}\nafter\n"
    assert bench.replace_block(text, "new") == f"intro\n{bench.BEGIN}\nnew\n{bench.END}\nafter\n"
    with pytest.raises(SystemExit, match="must contain one"):
        bench.replace_block("no markers here", "new")
    with pytest.raises(SystemExit, match="must contain one"):
        bench.replace_block(text + bench.BEGIN, "new")


def test_readme_has_the_markers() -> None:
    bench = _module()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count(bench.BEGIN) == 1 and readme.count(bench.END) == 1
