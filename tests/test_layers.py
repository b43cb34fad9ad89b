"""The package layer order of DESIGN.md, enforced on every module's imports (parsed with `ast`).

Module-level, function-level, TYPE_CHECKING and relative imports all count, as do lazy imports (a dict
value or an `importlib.import_module` argument that is exactly a dotted `verl.*` module path). A command
line naming a module to run in a subprocess (distributed/launch.py's `-m verl.cli.main`) is not an import. A package may
import itself and any package of a strictly lower layer; `algorithms` may import only torch and the standard library.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl"

# Layer of each top-level package (or module) of verl. Lower layers never import higher ones.
LAYERS: dict[str, int] = {
    "errors": 0,
    "sandbox": 1,        # running model-written code: standard library and errors only
    "utils": 1,          # dtype spellings, position ids: torch only
    "algorithms": 1,     # pure tensor math (further restricted below)
    "batch": 2,          # RolloutBatch and its layout table: errors and utils only
    "config": 2,         # the typed schema; reads the estimator table and the dtype table
    "data": 3,
    "rewards": 3,
    "models": 3,
    "checkpoint": 3,
    "tracking": 3,
    "view": 3,           # the run viewer (`verl view`): reads a run's files, serves or writes the page
    "distributed": 3,
    "env": 4,            # prompt source (data) + reward (rewards); the episode protocol a rollout runs
    "rollout": 5,        # engines, multi-turn and agent episodes, asynchronous rollout ranks
    "trainer": 6,
    "demos": 7,          # recipes on top of the trainers
    "compat": 7,         # volcengine/verl entry points and command translation
    "cli": 8,
}

# Third-party packages `algorithms` may import, besides the standard library and itself.
ALGORITHMS_THIRD_PARTY = {"torch"}

# Public re-exports that deliberately reach up: file -> the higher packages it may import, and why.
EXEMPT: dict[str, set[str]] = {
    "verl/__init__.py": set(LAYERS),              # the public API re-exports trainers and the loader lazily
    "verl/utils/hf_loader.py": {"models"},      # documented path of verl.models.hf_loader.load_hf_model
    # volcengine/verl's names and keys (`verl.compat.keys`, a table importing nothing of verl) are accepted or
    # hinted at where the config is parsed
    "verl/config/loader.py": {"compat"},
    "verl/config/rollout_algorithm.py": {"compat"},
    "verl/config/model_roles.py": {"compat"},
    # upstream's entry points (`python -m verl.trainer.main_ppo ...`) at upstream's paths, as thin shims
    "verl/trainer/main_ppo.py": {"compat"},
    "verl/trainer/fsdp_sft_trainer.py": {"compat"},
}

_DOTTED_VERL = re.compile(r"verl(\.[A-Za-z_]\w*)+")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module_path(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(_DOTTED_VERL.fullmatch(node.value))


def _call_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def imported_modules(source: str, module: str, *, is_package: bool) -> list[tuple[str, int]]:
    """(absolute module name, line) for every import in `source`, relative ones resolved against `module`."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base)
                if node.module:
                    found.append((f"{prefix}.{node.module}", node.lineno))
                else:  # `from . import x`: each name is a submodule (or a name of the package itself)
                    found += [(f"{prefix}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((node.module or "", node.lineno))
        elif isinstance(node, ast.Dict):  # lazy-import tables: {"Name": "verl.pkg.module"}
            found += [(v.value, v.lineno) for v in node.values if _is_module_path(v)]
        elif isinstance(node, ast.Call) and _call_name(node.func) in ("import_module", "__import__"):
            found += [(a.value, a.lineno) for a in node.args[:1] if _is_module_path(a)]
    return found


def violations(source: str, rel_path: str) -> list[str]:
    """Every import in the file at `rel_path` (relative to the repo root) that breaks the layer order."""
    path = ROOT / rel_path
    module = module_name(path)
    parts = module.split(".")
    if len(parts) < 2:  # verl/__init__.py
        own = None
    else:
        own = parts[1]
    allowed_up = EXEMPT.get(rel_path, set())
    problems = []
    for target, line in imported_modules(source, module, is_package=path.name == "__init__.py"):
        top = target.split(".")[0]
        where = f"{rel_path}:{line}"
        if own == "algorithms" and top != "verl":
            if top not in ALGORITHMS_THIRD_PARTY and top not in sys.stdlib_module_names:
                problems.append(f"{where}: algorithms imports {target}; it may import only torch and the stdlib")
            continue
        if top != "verl" or own is None:
            continue
        tparts = target.split(".")
        other = tparts[1] if len(tparts) > 1 else None
        if other == own:
            continue
        if other is None:
            problems.append(f"{where}: imports the `verl` root package (it re-exports the trainers); "
                            "import the defining module instead")
        elif own == "algorithms":
            problems.append(f"{where}: algorithms imports {target}; it may import only torch and the stdlib")
        elif other not in LAYERS:
            problems.append(f"{where}: imports {target}, a package missing from LAYERS in tests/test_layers.py")
        elif LAYERS[other] >= LAYERS[own] and other not in allowed_up:
            problems.append(f"{where}: {own} (layer {LAYERS[own]}) imports {target} "
                            f"({other}, layer {LAYERS[other]}); lower layers never import higher ones")
    return problems


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_layer():
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in _modules()} - {"__init__"}
    assert tops == set(LAYERS), (f"add these to LAYERS: {sorted(tops - set(LAYERS))}; "
                                 f"stale: {sorted(set(LAYERS) - tops)}")


def test_exemptions_exist():
    assert all((ROOT / rel).is_file() for rel in EXEMPT)


def test_imports_follow_the_layer_order():
    problems = []
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        problems += violations(path.read_text(encoding="utf-8"), rel)
    assert not problems, "layer violations:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("rel_path", "source", "expected"),
    [
        ("verl/trainer/x.py", "def f():\n    from verl.cli.main import main\n",
         "trainer (layer 6) imports verl.cli.main"),
        ("verl/utils/x.py", "import verl.models.tiny\n", "utils (layer 1) imports verl.models.tiny"),
        ("verl/data/x.py", "from verl.trainer import batch\n", "data (layer 3) imports verl.trainer"),
        ("verl/models/x.py", "if True:\n    from verl.trainer.rl_trainer import RLTrainer\n", "imports verl.trainer"),
        ("verl/distributed/x.py", "from verl.cli import main\n", "imports verl.cli"),
        ("verl/env/x.py", "from ..trainer.batch import RolloutBatch\n", "env (layer 4) imports verl.trainer.batch"),
        ("verl/rollout/sub/x.py", "from ...cli import main\n", "rollout (layer 5) imports verl.cli"),
        ("verl/algorithms/x.py", "import numpy as np\n", "algorithms imports numpy"),
        ("verl/algorithms/x.py", "from verl.errors import ConfigError\n", "algorithms imports verl.errors"),
        ("verl/config/x.py", "_LAZY = {'A': 'verl.data.load'}\n", "config (layer 2) imports verl.data.load"),
        ("verl/trainer/x.py", "from verl import RLTrainer\n", "imports the `verl` root package"),
        ("verl/rewards/x.py", "importlib.import_module('verl.env.base')\n", "rewards (layer 3) imports verl.env.base"),
    ],
)
def test_a_violating_import_is_caught(rel_path, source, expected):
    """The checker itself: each synthetic module breaks the order once and must be reported."""
    found = violations(source, rel_path)
    assert len(found) == 1 and expected in found[0], found


def test_allowed_imports_pass():
    ok = ("import torch\nimport math\nfrom .core import masked_mean\nfrom . import kl\n")
    assert violations(ok, "verl/algorithms/x.py") == []
    assert violations("from verl.utils.dtype import resolve_dtype\nfrom . import fsdp\n", "verl/config/x.py") == []
    assert violations("from verl.models.hf_loader import load_hf_model\n", "verl/utils/hf_loader.py") == []
    assert violations("from verl.models.hf_loader import load_hf_model\n", "verl/utils/other.py") != []


# Rooms of verl/trainer, lowest first: a room imports its own modules and those of strictly lower rooms; the
# modules at trainer/'s top (the entry points) sit above every room.
TRAINER_ROOMS: dict[str, int] = {
    "forward": 1,   # response log-probs, packing, sequence parallelism
    "build": 1,     # a role's model, process setup, FSDP launch, precision, optimizer
    "rl": 2,        # the RL step's stages after sampling
    "checks": 3,    # start-up checks
    "compose": 4,   # the parts a trainer is built from, the runtime, the loop
    "offline": 5,   # SFT, DPO, reward models
}
TRAINER_TOP = max(TRAINER_ROOMS.values()) + 1


def _modules_by_name() -> dict[str, Path]:
    return {module_name(p): p for p in _modules()}


def module_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The verl modules `path` imports, each resolved to a module file: `from pkg import sub` names `pkg.sub`
    where that is a module, a dotted name past a module is cut back to it."""
    found: set[str] = set()
    module = module_name(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("verl"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            if subs:
                found |= subs
    for target, _ in imported_modules(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py"):
        if not target.startswith("verl.") and target != "verl":
            continue
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)
    # `from pkg import sub` resolved to the submodule above also yields `pkg` from imported_modules: drop it
    # when every name imported from it is a submodule
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known and all(
                f"{node.module}.{a.name}" in known for a in node.names):
            found.discard(node.module)
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[2] in TRAINER_ROOMS else None


def test_trainer_rooms_follow_their_order():
    known = _modules_by_name()
    rooms = {p.name for p in (PACKAGE / "trainer").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == set(TRAINER_ROOMS), (
        f"rooms of verl/trainer missing from TRAINER_ROOMS or stale: {rooms ^ set(TRAINER_ROOMS)}")
    problems = []
    for module, path in known.items():
        if not module.startswith("verl.trainer."):
            continue
        own = _room(module)
        floor = TRAINER_ROOMS[own] if own else TRAINER_TOP
        for target in module_imports(path, known):
            if not target.startswith("verl.trainer.") or _room(target) == own:
                continue
            other = _room(target)
            if other is None or TRAINER_ROOMS[other] >= floor:
                problems.append(f"{path.relative_to(ROOT)}: {own or 'trainer top'} (floor {floor}) imports {target} "
                                f"({other or 'trainer top'}); a room imports only lower rooms")
    assert not problems, "trainer room violations:\n" + "\n".join(problems)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_module_of_verl_is_part_of_an_import_cycle():
    """Function-level and TYPE_CHECKING imports count: neither may hide a cycle."""
    known = _modules_by_name()
    graph = {module: module_imports(path, known) for module, path in known.items()}
    assert not import_cycles(graph), f"import cycles: {import_cycles(graph)}"


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
