"""User code (reward functions, environments) is loaded only from the file or module the user names.

One file becomes one module, named after its absolute path, so two files called `reward.py` never
replace each other and a second load reuses the first. Every failure is raised through `fail`, which the
caller builds with its own config key and error class. When user code raises, `raised_at` finds the
user's own line (file, number, text) for the message: the one line they need from a long traceback that
runs mostly through verl's frames.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from verl.errors import VerlError

Fail = Callable[[str], VerlError]

_VERL = Path(__file__).resolve().parents[1]


def _library_roots() -> list[Path]:
    """Folders of code the user did not write: the standard library and installed packages."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    roots |= {sysconfig.get_paths().get(name, "") for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    return [Path(root).resolve() for root in roots if root]


def _under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def raised_at(exc: BaseException) -> str:
    """`File "x.py", line 7, in fn: return 1 / n` for the innermost frame of `exc` in user code (not verl,
    not the standard library or an installed package; failing that, the innermost frame outside verl).
    Empty when every frame is verl's (the error is ours, and its message says so)."""
    frames = traceback.extract_tb(exc.__traceback__)
    libraries = _library_roots()
    outside_verl = [f for f in frames
                    if not _under(Path(f.filename).resolve(), _VERL) and not f.filename.startswith("<")]
    users = [f for f in outside_verl if not any(_under(Path(f.filename).resolve(), root) for root in libraries)]
    chosen = (users or outside_verl or [None])[-1]
    if chosen is None:
        return ""
    text = f"File \"{chosen.filename}\", line {chosen.lineno}, in {chosen.name}"
    return f"{text}: {chosen.line.strip()}" if chosen.line else text


def resolve_user_path(path_text: str, base_dir: str | Path | None, *, what: str, fail: Fail) -> Path:
    """The one rule for a relative path the user wrote (a data file, a reward or environment file): it is
    looked up in the working directory and, when the run has a config file, in that file's folder, and must
    be found in exactly one of them (or both name the same file). A path typed on the command line is
    relative to where the user stands, one written in a YAML to the YAML: looking in both places serves
    both, and a name found in both (two different files) is refused rather than picked silently. Missing
    or ambiguous: `fail` gets a message naming every place tried (`what` names the path, e.g. "data file").
    """
    path = Path(path_text).expanduser()
    if path.is_absolute():
        if not path.exists():
            raise fail(f"{what} {path} does not exist. Fix the path.")
        return path.resolve()
    places = [("the working directory", Path.cwd())]
    if base_dir is not None and Path(base_dir).resolve() != Path.cwd().resolve():
        places.append(("the config file's folder", Path(base_dir)))
    tried = [(name, (folder / path).resolve()) for name, folder in places]
    found = list(dict.fromkeys(candidate for _, candidate in tried if candidate.exists()))
    if len(found) == 1:
        return found[0]
    listed = " and ".join(f"{candidate} ({name})" for name, candidate in tried)
    if not found:
        raise fail(f"{what} {path_text} does not exist: tried {listed}. A relative path is looked up in the "
                   "working directory and the config file's folder; fix it or give an absolute path.")
    raise fail(f"{what} {path_text} is ambiguous: both {listed} exist. Give the absolute path of the one "
               "you mean.")


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
        at = raised_at(e)
        raise fail(f"importing {label} {path} raised {type(e).__name__}: {e}" + (f",\n  at {at}" if at else "")
                   + ". Fix the error in that file (it runs once when training starts).") from e
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


__all__ = ["exec_user_file", "import_user_module", "raised_at", "resolve_user_path"]
