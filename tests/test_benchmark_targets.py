"""`make bench` (benchmarks/targets.py): each target reruns its documented row and reads its figure."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # a dataclass looks its module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _rows(table: str) -> dict[str, str]:
    """command -> result of benchmark table `table` in docs/: the latest row of each command (older rows of
    another CPU may predate the script's current summary line)."""
    docs = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))
    block = re.search(rf"<!-- bench:{table}:begin -->\n(.*?)\n<!-- bench:{table}:end -->", docs, re.S)
    assert block, f"no table {table} in docs/"
    latest: dict[str, tuple[str, str]] = {}
    for row in block.group(1).splitlines()[2:]:
        command, _, date, result = (c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|")))
        if date >= latest.get(command.strip("`"), ("", ""))[0]:
            latest[command.strip("`")] = date, result
    return {command: result for command, (_, result) in latest.items()}


def test_each_target_reruns_a_documented_row_and_reads_its_figure_from_it() -> None:
    """The command a target runs is the one its table records (so --write-docs replaces that row, TRL's path
    shown as the placeholder), and its pattern finds the figure in what the script wrote there."""
    targets, doc_table = _load("targets"), _load("doc_table")
    elsewhere = Path("/elsewhere/trl")
    for target in targets.TARGETS:
        rows = _rows(Path(target.script).stem)
        command = doc_table.command_line(target.script, target.argv(elsewhere))
        assert command in rows, f"{target.name}: no row of `{command}` in docs/"
        assert target.figure(rows[command]) is not None, f"{target.name}: {target.pattern!r} not in {rows[command]!r}"


def test_figures_are_judged_against_their_goals() -> None:
    targets = _load("targets")
    by_name = {t.name: t for t in targets.TARGETS}
    tiny, ten_m, dpo, run = (by_name[n] for n in ("grpo-tiny", "grpo-10m", "dpo", "make-run"))
    out = ("ratio verl vs TRL GRPOTrainer (tiny): 2.54x (min 2.26x, max 2.63x); load average 1.1/3.4/4.3\n"
           "ratio verl vs TRL GRPOTrainer (10m): 1.53x (min 1.37x, max 1.76x)")
    assert (tiny.figure(out), ten_m.figure(out)) == (2.54, 1.53)
    assert tiny.verdict(2.54) == "GRPO vs TRL, tiny 2.54x (>= 3x): not met"
    assert dpo.verdict(dpo.figure("ratio verl/TRL steps/s: median 2.12x (min 2.06x, max 2.38x)")) == (
        "DPO vs TRL 2.12x (>= 2x): met")
    assert run.figure("smallest gain +35.2 pts, lowest after RL 75.8%, slowest 66 s") == 66
    assert (dpo.verdict(2.2), run.verdict(66)) == ("DPO vs TRL 2.20x (>= 2x): met",
                                                   "make run, slowest of 4 seeds 66 s (< 60 s): not met")
    assert (run.met(59), run.met(60)) == (True, False)
    assert tiny.figure("Traceback (most recent call last)") is None
    assert tiny.verdict(None) == "GRPO vs TRL, tiny: no figure (>= 3x)"
    assert targets.pick_verdicts(["ratio a: 2x", "target: DPO vs TRL 2.20x (>= 2x): met"]) == [
        "DPO vs TRL 2.20x (>= 2x): met"]


def test_only_picks_named_targets_in_their_order() -> None:
    targets = _load("targets")
    assert [t.name for t in targets.pick("dpo, grpo-tiny")] == ["grpo-tiny", "dpo"]
    assert len(targets.pick(None)) == len(targets.TARGETS)
    with pytest.raises(SystemExit, match="unknown target"):
        targets.pick("grpo-tiny,fast")
