"""Figures in the docs are rows written by the benchmark scripts (benchmarks/doc_table.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _doc_table():
    spec = importlib.util.spec_from_file_location("doc_table", ROOT / "benchmarks" / "doc_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_rerun_replaces_its_row_and_keeps_the_others() -> None:
    dt = _doc_table()
    begin, end = dt.markers("x")
    text = f"intro\n{begin}\n{end}\nafter\n"
    text = dt.upsert_row(text, "x", "python benchmarks/x.py --a", "CPU A (2 cores)", "2026-01-01", "1.5x")
    text = dt.upsert_row(text, "x", "python benchmarks/x.py --a", "CPU B (2 cores)", "2026-01-01", "1.7x")
    text = dt.upsert_row(text, "x", "python benchmarks/x.py --a", "CPU A (2 cores)", "2026-01-02", "1.6x | y")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == ["| `python benchmarks/x.py --a` | CPU A (2 cores) | 2026-01-02 | 1.6x \\| y |",
                    "| `python benchmarks/x.py --a` | CPU B (2 cores) | 2026-01-01 | 1.7x |"]
    assert text.startswith("intro\n") and text.endswith(f"{end}\nafter\n")
    with pytest.raises(SystemExit, match="must contain one"):
        dt.upsert_row("no markers", "x", "c", "cpu", "d", "r")


def test_the_command_drops_the_docs_flags_and_the_pickers_read_the_output() -> None:
    dt = _doc_table()
    args, write, doc = dt.split_doc_args(["--rounds", "5", "--write-docs", "--docs", "d.md"])
    assert (args, write, doc) == (["--rounds", "5"], True, Path("d.md"))
    assert dt.command_line("/x/benchmarks/rollout.py", args) == "python benchmarks/rollout.py --rounds 5"
    assert dt.ratio_lines(["table", "ratio a vs b: 2.00x"]) == ["ratio a vs b: 2.00x"]
    lines = ["| seed | gain |", "|---|---|", "| 1 | +3 pts |", "done: 1/1"]
    assert dt.table_and("done")(lines) == ["1: gain +3 pts", "done: 1/1"]


def test_every_wired_script_has_its_table_and_performance_md_stays_short() -> None:
    docs = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if script.name != "doc_table.py" and "doc_table.run(" in script.read_text(encoding="utf-8"):
            assert f"<!-- bench:{script.stem}:begin -->" in docs, f"no table in docs/ for {script.name}"
    performance = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert len(performance.splitlines()) < _doc_table().PERFORMANCE_MAX_LINES, (
        "docs/performance.md is too long: delete the rows that newer ones supersede")
    for block in re.findall(r"<!-- bench:\w+:begin -->\n(.*?)\n<!-- bench:\w+:end -->", docs, re.S):
        for row in block.splitlines()[2:]:
            assert row.startswith("| `python") or row.startswith("| `"), row
            assert len(re.split(r"(?<!\\)\|", row.strip().strip("|"))) == 4, row


def test_a_row_carries_no_scratch_path_of_the_machine_it_ran_on() -> None:
    dt = _doc_table()
    args = ["--trl-path", "/tmp/trl-side", "--run-root=/work/wt/runs", "trainer.run_dir=/tmp/r", "/home/me/x.jsonl",
            "--out", str(ROOT / "runs" / "a"), "data/x.jsonl", "--sizes", "10m"]
    assert dt.command_line("/x/benchmarks/b.py", args) == (
        "python benchmarks/b.py --trl-path TRL_PATH --run-root=RUN_ROOT trainer.run_dir=RUN_DIR PATH --out runs/a "
        "data/x.jsonl --sizes 10m")


# Rows written before `command_line` dropped scratch paths, on pages edited elsewhere: (page, text). Rerun the
# row's script (or edit the row) and delete its entry here.
def test_no_row_in_the_docs_names_a_scratch_path() -> None:
    """Rows carry the command and the CPU, not one machine's folders (/tmp/..., /work/...)."""
    problems = []
    for page in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        rel = page.relative_to(ROOT).as_posix()
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"<!-- ([\w:-]+):begin -->\n(.*?)\n<!-- \1:end -->", text, re.S):
            for row in block[1].splitlines():
                if not row.startswith("|") or not ("/tmp/" in row or "/work/" in row):
                    continue
                problems.append(f"{rel}: {row[:160]}")
    assert not problems, "rows with a machine's scratch path (benchmarks/doc_table.command_line drops them):\n" + (
        "\n".join(problems))
