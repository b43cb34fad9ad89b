"""Build a `RunConfig` from YAML + dotted overrides + legacy flags, reporting every problem at once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from verl.compat.keys import verl_key_hint
from verl.config.schema import RunConfig
from verl.errors import ConfigError
from verl.utils.suggest import did_you_mean

# Flags from the deployment guides users already have in their scripts -> our dotted keys.
LEGACY_FLAGS: dict[str, str] = {
    "actor_device_ids": "devices.actor",
    "critic_device_ids": "devices.critic",
    "ref_device_id": "devices.ref",
    "reward_device_id": "devices.reward",
    "teacher_device_ids": "devices.teacher",
    "rollout_device_ids": "devices.rollout",
    "num_gpus_per_node": "devices.num_gpus_per_node",
    "save_interval": "checkpoint.save_interval",
    "async_save": "checkpoint.async_save",
    "save_total_limit": "checkpoint.save_total_limit",
}


def parse_value(text: str) -> Any:
    """Parse an override value the way YAML would (`1e-6`, `true`, `[0,1]`, `null`), falling back to text."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:  # YAML 1.1 reads `1e-6` as a string; users mean a number.
            return float(value) if any(c in value.lower() for c in "e.") else value
        except ValueError:
            return value
    return value


def split_legacy_flags(argv: Sequence[str], origins: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Turn `--actor_device_ids 0,1` / `--async_save=False` into `devices.actor=0,1` overrides.

    Returns (overrides, remaining argv); bare `key=value` items pass through as overrides. Unknown
    `--flags` are left for the caller to report.
    """
    overrides: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = LEGACY_FLAGS.get(name.replace("-", "_")) if name else None
        if key is None:
            # a `key=value` override typed among the flags: it keeps its place, so the last one wins
            if not arg.startswith("-") and "=" in arg:
                overrides.append(arg)
                if origins is not None and arg.partition("=")[0].strip():
                    origins[arg.partition("=")[0].strip()] = arg
            else:
                rest.append(arg)
            i += 1
            continue
        if eq:
            value = inline
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            raise ConfigError(f"flag --{name} needs a value, e.g. --{name} 0,1 (it maps to {key})")
        overrides.append(f"{key}={value}")
        if origins is not None:
            origins[key] = f"--{name} {value}"
    return overrides, rest


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """`tree['a']['b'] = value` for `a.b`, creating the sections on the way."""
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict, overrides: Sequence[str]) -> list[str]:
    """Apply `a.b=c` strings onto a nested dict; returns the malformed ones as problem lines."""
    problems = []
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not p for p in key.split(".")):
            problems.append(f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. actor.lr=1e-6")
            continue
        set_dotted(tree, key, parse_value(raw.strip()))
    return problems


# Keys people look for in another section than ours (the issue tracker's and other frameworks' names).
ELSEWHERE = {"trainer.val_n": "rollout.val_n", "trainer.val_k": "rollout.val_k",
             "trainer.val_temperature": "rollout.val_temperature"}


def _fields_at(path: Sequence[str | int]) -> list[str]:
    """Names of the valid keys of the section that `path` points into (for "did you mean")."""
    model: type[BaseModel] | None = RunConfig
    for part in path:
        if model is None:
            return []
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []


def command_line_origin(dotted: str, origins: Mapping[str, str]) -> str | None:
    """What the user typed on the command line that set `dotted` (or the section or list holding it, or the
    keys inside it)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        origin = origins.get(".".join(parts[:end]))
        if origin is not None:
            return origin
    inside = [origin for key, origin in origins.items() if key.startswith(dotted + ".")]
    return ", ".join(inside) or None


def _describe(error: Mapping[str, Any], origins: Mapping[str, str], tree: Mapping[str, Any]) -> str:
    loc = [p for p in error["loc"] if not (isinstance(p, str) and ("[" in p or p in {"bool", "function-after"}))]
    dotted = ".".join(str(p) for p in loc)
    origin = command_line_origin(dotted, origins)
    where = f" (from the command line: {origin})" if origin else ""
    if error["type"] == "extra_forbidden":
        known = _fields_at(loc[:-1])
        section = "".join(f"{part}." for part in loc[:-1])
        moved = ELSEWHERE.get(dotted)
        hint = (f" It is {moved} here (validation's sampling keys sit with the rollout's)." if moved else
                verl_key_hint(tree, loc) or did_you_mean(str(loc[-1]), known, cutoff=0.5, prefix=section))
        return f"{dotted}: unknown key{where}.{hint} Valid keys here: {', '.join(known)}"
    value = error.get("input")
    shown = f" (got {value!r})" if not isinstance(value, (dict, list)) else ""
    hint = verl_key_hint(tree, loc) if isinstance(value, Mapping) else ""  # e.g. verl's algorithm.kl_ctrl section
    return f"{dotted}: {error['msg']}{shown}{where}" + (f".{hint}" if hint else "")


def build_config(tree: Mapping[str, Any], *, source: str = "config",
                 origins: Mapping[str, str] | None = None) -> RunConfig:
    """Validate a nested dict into a RunConfig, or raise one ConfigError listing every problem.

    `origins` maps dotted keys set on the command line to what was typed there; their problems say so.
    """
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping of sections (model:, data:, ...)")
    try:
        return RunConfig.model_validate(dict(tree))
    except ValidationError as exc:
        lines = [_describe(e, origins or {}, tree) for e in exc.errors()]
        error = ConfigError(f"{source} has {len(lines)} problem(s):\n" + "\n".join(f"  - {line}" for line in lines))
        error.problems = lines  # one per problem, for a caller that adds its own
        raise error from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a YAML file (see examples/)")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text: byte {exc.start} (0x{exc.object[exc.start]:02x}) "
                          f"cannot be decoded ({exc.reason}). Fix: save the file as UTF-8 (e.g. `iconv -f latin1 "
                          f"-t utf-8 {path}`) or remove that byte") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc}); check its permissions") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...)")
    return tree


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    legacy_argv: Sequence[str] = (),
) -> RunConfig:
    """YAML file (optional) + `key=value` overrides + legacy `--flags` -> RunConfig.

    Later sources win: YAML < `legacy_argv` < `overrides`. Within `legacy_argv` (the command line as typed:
    legacy flags and `key=value` items mixed, which is how `verl train` passes it) the last setting of a key
    wins, whether a flag or a `key=value` set it.
    """
    tree = read_yaml(path) if path is not None else {}
    origins: dict[str, str] = {}  # dotted key -> what set it on the command line
    legacy, rest = split_legacy_flags(legacy_argv, origins)
    if rest:
        known = ", ".join(f"--{f}" for f in LEGACY_FLAGS)
        raise ConfigError(f"unknown flag(s) on the command line: {' '.join(rest)}; legacy flags understood: {known}")
    problems = [f"{p} (from the command line)" for p in apply_overrides(tree, [*legacy, *overrides])]
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key:
            origins[key] = item
    source = str(path) if path is not None else "config"
    if origins or problems:
        source += " + command line"
    try:
        config = build_config(tree, source=source, origins=origins)
    except ConfigError as exc:
        if not problems:
            raise
        problems = [*getattr(exc, "problems", [str(exc)]), *problems]
        config = None
    if problems:
        raise ConfigError(f"{source} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    if path is not None:
        config._source_dir = str(Path(path).resolve().parent)
    return config


# config_to_yaml's recent results by the config's JSON text: every RL step snapshots the config for a checkpoint,
# and dumping YAML (pure Python, ~5 ms) costs far more than the JSON text (pydantic-core) that identifies it.
_YAML_BY_JSON: dict[str, str] = {}


def config_to_yaml(config: RunConfig) -> str:
    key = config.model_dump_json()
    text = _YAML_BY_JSON.get(key)
    if text is None:
        if len(_YAML_BY_JSON) >= 8:
            _YAML_BY_JSON.clear()
        text = _YAML_BY_JSON[key] = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    return text
