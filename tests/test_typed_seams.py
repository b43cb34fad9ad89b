"""The seams between packages are typed: no `env`, `tokenizer` or `mapping` parameter or field of verl is `Any`
(`Environment`/`MultiTurnEnvironment`/`EpisodeEnv`, `verl.utils.tokenizer_protocol.Tokenizer`, `DeviceMapping`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEAMS = {"env", "tokenizer", "reward_tokenizer", "mapping"}


def untyped_seams(source: str) -> list[tuple[str, int]]:
    """(name, line) of every argument or annotated name in SEAMS whose annotation is exactly `Any`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.arg in SEAMS and isinstance(node.annotation, ast.Name):
            found += [(node.arg, node.lineno)] if node.annotation.id == "Any" else []
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in SEAMS
              and isinstance(node.annotation, ast.Name) and node.annotation.id == "Any"):
            found.append((node.target.id, node.lineno))
    return found


def test_no_seam_of_verl_is_annotated_any():
    problems = [f"{path.relative_to(ROOT)}:{line}: {name}: Any" for path in sorted((ROOT / "verl").rglob("*.py"))
                for name, line in untyped_seams(path.read_text(encoding="utf-8"))]
    assert not problems, "type these seams:\n" + "\n".join(problems)


def test_the_finder_finds_them():
    source = "def f(env: Any, tokenizer: 'Tokenizer', mapping: Any = None):\n    pass\nclass C:\n    env: Any = None\n"
    assert sorted(untyped_seams(source), key=lambda f: (f[1], f[0])) == [("env", 1), ("mapping", 1), ("env", 4)]
