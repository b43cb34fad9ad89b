"""Benchmark figures into the docs: every run of a script with `--write-docs` becomes one table row.

Each script owns one table in a docs page (docs/performance.md unless it says otherwise), between
`<!-- bench:NAME:begin -->` and `<!-- bench:NAME:end -->`, NAME being the script's file name without `.py`.
A row is (command, CPU, date, result): the command as run from the repository root, any path outside the
checkout shown as a placeholder (`--trl-path TRL_PATH`, so no machine's scratch folders), and the result the
script's summary lines (its ratio lines unless the script picks others). A new run replaces the row with the
same command and CPU, so a table holds the latest figure per (script, command, CPU) and never grows with
reruns. Prose in the docs cites these tables and carries no figures of its own.

Wiring a script: end it with ``raise SystemExit(doc_table.run(main))`` (or ``run(main, pick=...)``);
``python benchmarks/x.py ARGS --write-docs`` then runs ``main`` as usual, echoing its output, and records
the row. ``--docs PATH`` writes into another page.
"""

from __future__ import annotations

import datetime
import io
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE = ROOT / "docs" / "performance.md"
PERFORMANCE_MAX_LINES = 150  # docs/performance.md stays under this (tests/test_benchmark_docs.py)
HEADER = ["| command | CPU | date | result |", "|---|---|---|---|"]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def cpu_label(cores: int | None = None) -> str:
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"{cpu_model()} ({cores} cores)"


def _is_path(value: str) -> bool:
    return value.startswith(("/", "~")) or value == ".." or value.startswith("../")


def _portable(value: str, name: str) -> str:
    """`value` as a row shows it: a path in this checkout relative to it, any other path (a scratch folder of
    one machine: /tmp/..., a home directory, a sibling worktree) as the placeholder `name`."""
    if not _is_path(value):
        return value
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if path == ROOT or ROOT in path.parents:
        return path.relative_to(ROOT).as_posix() or "."
    return name


def _placeholder(option: str) -> str:
    """The placeholder of an option's path value: `--run-root` -> RUN_ROOT, `trainer.run_dir` -> RUN_DIR."""
    return option.lstrip("-").rpartition(".")[2].replace("-", "_").upper() or "PATH"


def command_line(script: str, args: list[str]) -> str:
    """The command a row records, as run from the repository root: paths outside the checkout become
    placeholders (`--trl-path TRL_PATH`), so a row carries no machine's scratch folders."""
    shown: list[str] = []
    for i, arg in enumerate(args):
        option = args[i - 1] if i and args[i - 1].startswith("--") and "=" not in args[i - 1] else ""
        if "=" in arg and not _is_path(arg):  # --opt=VALUE or key=VALUE
            key, _, value = arg.partition("=")
            shown.append(f"{key}={_portable(value, _placeholder(key))}")
        else:
            shown.append(_portable(arg, _placeholder(option) if option else "PATH"))
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *shown])


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _key(row: str) -> tuple[str, str]:
    cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
    return (cells[0], cells[1]) if len(cells) >= 2 else (row, "")


def upsert_row(text: str, name: str, command: str, cpu: str, date: str, result: str, where: str = "") -> str:
    """`text` with the row for (command, CPU) in table `name` replaced (or added); other rows kept."""
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{where or 'the page'} must contain one '{begin}' line followed by one '{end}' line "
                         f"where the table of benchmarks/{name}.py goes; add them.")
    head, rest = text.split(begin, 1)
    block, tail = rest.split(end, 1)
    rows = [line for line in block.strip().splitlines() if line.startswith("|") and line not in HEADER]
    new = f"| `{command}` | {_cell(cpu)} | {date} | {_cell(result)} |"
    rows = [row for row in rows if _key(row) != _key(new)] + [new]
    rows.sort(key=_key)
    return f"{head}{begin}\n" + "\n".join(HEADER + rows) + f"\n{end}{tail}"


def record(name: str, command: str, result: str, doc: Path = PERFORMANCE, cpu: str | None = None,
           date: datetime.date | None = None) -> None:
    date = date or datetime.datetime.now(datetime.timezone.utc).date()
    text = doc.read_text(encoding="utf-8")
    doc.write_text(upsert_row(text, name, command, cpu or cpu_label(), date.isoformat(), result, str(doc)),
                   encoding="utf-8")
    print(f"wrote the row of `{command}` into {doc}")
    lines = len(doc.read_text(encoding="utf-8").splitlines())
    if doc.resolve() == PERFORMANCE.resolve() and lines >= PERFORMANCE_MAX_LINES:
        print(f"warning: {doc} has {lines} lines (the limit is {PERFORMANCE_MAX_LINES - 1}): delete the rows that "
              "newer ones supersede (older code, or a command no longer worth keeping)")


def ratio_lines(lines: list[str]) -> list[str]:
    """The default result: the lines that start with 'ratio' (every script's final ratio line)."""
    return [line.strip() for line in lines if line.strip().lower().startswith("ratio")]


def prefixed(*starts: str) -> Callable[[list[str]], list[str]]:
    """A result picker: the lines that start with one of `starts` (after leading spaces)."""
    def pick(lines: list[str]) -> list[str]:
        return [" ".join(line.split()) for line in lines if line.strip().startswith(starts)]
    return pick


def table_and(*starts: str) -> Callable[[list[str]], list[str]]:
    """A result picker for a script that prints a markdown table: each table row as "first cell: header
    value, ...", then the lines that start with one of `starts`."""
    def pick(lines: list[str]) -> list[str]:
        table = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines
                 if line.strip().startswith("|") and not set(line.strip()) <= set("|-: ")]
        out = []
        if table:
            header, *rows = table
            out = [f"{row[0]}: " + ", ".join(f"{h} {c}" for h, c in zip(header[1:], row[1:], strict=False))
                   for row in rows]
        return out + prefixed(*starts)(lines) if starts else out
    return pick


def stage_lines(lines: list[str]) -> list[str]:
    """benchmarks/grpo_stages.py's result: per model size, each stage's median ms (least disturbed step)."""
    summaries = [line.removeprefix("summary: ").strip() for line in lines if line.startswith("summary: ")]
    if summaries:  # --peak: one line per size and kernel holds the row
        return summaries
    out: list[str] = []
    for line in lines:
        words = line.split()
        if len(words) > 1 and words[0].endswith(":") and words[1].isdigit():
            kernel = next((w.rstrip(";") for w in words if w.startswith("trainer.cpu_matmul=")), "")
            out.append(f"{words[0][:-1]}{f' ({kernel})' if kernel else ''}: median ms (min):")
        elif line.startswith("per step over"):
            out.append(line.strip())
        elif len(words) == 3 and out and all(w.replace(".", "", 1).isdigit() for w in words[1:]):
            out[-1] += f" {words[0]} {float(words[2]):.0f} ({float(words[1]):.0f})"
    return out


class _Tee(io.TextIOBase):
    def __init__(self, stream: io.TextIOBase) -> None:
        self.stream, self.buffer_text = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.buffer_text.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def split_doc_args(argv: list[str]) -> tuple[list[str], bool, Path | None]:
    """argv without `--write-docs` / `--docs PATH`, whether to write, and the page."""
    rest: list[str] = []
    write, doc = False, None
    it = iter(argv)
    for arg in it:
        if arg == "--write-docs":
            write = True
        elif arg == "--docs":
            doc = Path(next(it))
        elif arg.startswith("--docs="):
            doc = Path(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return rest, write, doc


def run(main: Callable[[], object], pick: Callable[[list[str]], list[str]] = ratio_lines,
        doc: Path = PERFORMANCE, name: str | None = None) -> int:
    """Run a benchmark's `main`, and with `--write-docs` record its summary lines as its table's row."""
    script = sys.argv[0]
    args, write, doc_arg = split_doc_args(sys.argv[1:])
    doc = doc_arg or doc
    sys.argv = [script, *args]
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        code = main()
    finally:
        sys.stdout = tee.stream
    if write:
        result = pick(tee.buffer_text.getvalue().splitlines())
        if not result:
            raise SystemExit("--write-docs: the run printed no summary line to record")
        record(name or Path(script).stem, command_line(script, args), "; ".join(result), doc)
    return int(code or 0)
