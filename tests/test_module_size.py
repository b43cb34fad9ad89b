"""No module of verl/ is over 600 lines: a longer one is split by concept into modules of its own package."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl"
MAX_LINES = 600


def oversized(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(path from `root`'s parent, line count) of every .py file under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append((path.relative_to(root.parent).as_posix(), lines))
    return found


def test_no_module_of_verl_is_over_600_lines():
    offenders = oversized(PACKAGE)
    assert not offenders, (f"modules over {MAX_LINES} lines (split each by concept into modules of its own "
                           "package):\n" + "\n".join(f"{path}: {lines} lines" for path, lines in offenders))


def test_the_check_reports_each_offender_with_its_line_count(tmp_path: Path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * 600, encoding="utf-8")
    (package / "sub" / "long.py").write_text("x = 1\n" * 601, encoding="utf-8")
    (package / "notes.txt").write_text("x\n" * 1000, encoding="utf-8")
    assert oversized(package) == [("pkg/sub/long.py", 601)]
