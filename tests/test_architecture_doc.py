"""docs/architecture.md stays true: every `verl.*` name it gives exists, and its layer and room tables are
the ones tests/test_layers.py enforces.

Names are resolved from the source files (with `ast`), without importing anything: `verl.a.b` is a module
or package under verl/, `verl.a.b.Name` a name that module defines or imports, `verl.a.b.Class.attr` a
member of a class defined there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layers import LAYERS, TRAINER_ROOMS  # pytest puts this folder on sys.path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

_CODE = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w./-])verl(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./-])verl/[\w./-]*\w")


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module (or class) body binds at its top level: definitions, assignments, imports."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
            lazy = any(isinstance(target, ast.Name) and target.id == "_LAZY" for target in node.targets)
            if lazy and isinstance(node.value, ast.Dict):  # names a module `__getattr__` imports on first use
                names |= {key.value: node for key in node.value.keys
                          if isinstance(key, ast.Constant) and isinstance(key.value, str)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _defined(node.body)
    return names


def resolve(dotted: str) -> str | None:
    """None when `dotted` names an existing module, package, or name in one; else why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path is None:
            continue
        rest = parts[cut:]
        body = ast.parse(path.read_text(encoding="utf-8")).body
        for i, name in enumerate(rest):
            node = _defined(body).get(name)
            if node is None:
                return f"{path.relative_to(ROOT)} defines no {'.'.join(rest[: i + 1])}"
            if i + 1 < len(rest):
                if not isinstance(node, ast.ClassDef):
                    return f"{'.'.join(rest[: i + 1])} in {path.relative_to(ROOT)} is not a class"
                body = node.body
        return None
    return "no such module or package under verl/"


def doc_names(text: str) -> set[str]:
    return {m.group() for span in _CODE.findall(text) for m in _DOTTED.finditer(span)}


def table_first_column(text: str, heading: str) -> dict[str, int]:
    """`{first cell: second cell}` of the first table under `## heading` (cells in backticks / integers)."""
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0].strip("`")] = int(cells[1])
    return rows


def test_every_named_module_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    names = doc_names(text)
    assert len(names) > 50, sorted(names)  # the parser found the names
    problems = [f"`{name}`: {why}" for name in sorted(names) if (why := resolve(name)) is not None]
    paths = {m.group() for span in _CODE.findall(text) for m in _PATH.finditer(span)}
    problems += [f"`{p}`: no such file or folder" for p in sorted(paths) if not (ROOT / p).exists()]
    assert not problems, "docs/architecture.md names what does not exist:\n" + "\n".join(problems)


def test_the_other_docs_name_what_exists() -> None:
    """The same check on every page of docs/ and the README: a module that moves leaves no stale name behind."""
    problems = []
    for page in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        spans = _CODE.findall(page.read_text(encoding="utf-8"))
        for name in sorted({m.group() for span in spans for m in _DOTTED.finditer(span)}):
            if (why := resolve(name)) is not None:
                problems.append(f"{page.relative_to(ROOT)}: `{name}`: {why}")
        for path in sorted({m.group() for span in spans for m in _PATH.finditer(span)}):
            if not (ROOT / path).exists():
                problems.append(f"{page.relative_to(ROOT)}: `{path}`: no such file or folder")
    assert not problems, "the docs name what does not exist (moved? renamed?):\n" + "\n".join(problems)


def test_the_resolver_refuses_what_is_missing() -> None:
    assert resolve("verl.trainer.rl.update") is None
    assert resolve("verl.trainer") is None
    assert resolve("verl.sandbox.run_code") is None  # a re-export
    assert resolve("verl.RLTrainer") is None  # imported on first use (`_LAZY`)
    assert resolve("verl.trainer.rl_trainer.RLTrainer.step") is None
    assert resolve("verl.trainer.rl.no_such_module") is not None
    assert resolve("verl.trainer.rl.update.no_such_name") is not None
    assert resolve("verl.trainer.rl_trainer.RLTrainer.no_such_method") is not None
    assert doc_names("`verl.a.b` and `python -m verl.c.d x`, not verl.e.f, not `verl/g.py`") == {"verl.a.b", "verl.c.d"}


def test_the_layer_table_is_test_layers() -> None:
    layers = table_first_column(DOC.read_text(encoding="utf-8"), "Package layers")
    assert {name.removeprefix("verl."): layer for name, layer in layers.items()} == LAYERS
    order = [name.removeprefix("verl.") for name in layers]
    assert [LAYERS[name] for name in order] == sorted(LAYERS[name] for name in order), "list the layers lowest first"


def test_the_room_table_is_test_layers() -> None:
    rooms = table_first_column(DOC.read_text(encoding="utf-8"), "Rooms of the trainer")
    assert {name.removeprefix("verl.trainer."): level for name, level in rooms.items()} == TRAINER_ROOMS
    assert list(rooms.values()) == sorted(rooms.values()), "list the rooms lowest first"
