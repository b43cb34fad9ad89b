"""User code (reward functions, environments) is loaded only from the file or module the user names.

One file becomes one module, named after its absolute path, so two files called `reward.py` never
replace each other and a second load reuses the first. Every failure is raised through `fail`, which the
caller builds with its own config key and error class.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from verl.errors import VerlError

Fail = Callable[[str], VerlError]


def resolve_user_path(path_text: str, base_dir: Path | None) -> Path:
    """`path_text` made absolute: relative paths resolve against `base_dir` (the config file's folder)."""
    path = Path(path_text).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    return path.resolve()


def exec_user_file(path: Path, *, namespace: str, label: str, fail: Fail) -> ModuleType:
    """Run the Python file `path` once as a module (`label` names it in errors, e.g. "reward file")."""
    mod_name = f"verl_user_{namespace}_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise fail(f"{path} cannot be loaded as Python; the file must be a .py module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise fail(f"importing {label} {path} raised {type(e).__name__}: {e}. Fix the error in that file "
                   "(it runs once when training starts).") from e
    return module


def import_user_module(mod_path: str, *, example: str, fail: Fail) -> ModuleType:
    """Import `mod_path` (an installed package's module); `example` shows the file form instead."""
    try:
        return importlib.import_module(mod_path)
    except ModuleNotFoundError as e:
        raise fail(f"module '{mod_path}' cannot be imported ({e}). Install the package that provides it, or "
                   f"name a file instead: '{example}'.") from e
    except Exception as e:
        raise fail(f"importing module '{mod_path}' raised {type(e).__name__}: {e}. Fix the error in that "
                   "module.") from e


__all__ = ["exec_user_file", "import_user_module", "resolve_user_path"]
