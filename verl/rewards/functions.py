"""Reward functions as loaded, and one per-sample call of one: what a reward worker needs, without torch.

`load_function` resolves a spec (a built-in, `file.py:fn`, `package.module:fn`) or takes a Python callable,
reads its signature once and checks it against the spec's kwargs, so a mistake fails at start-up;
`call_one` calls a per-sample function the way its signature asks (our `fn(prompt, response, ground_truth,
**metadata)`, or volcengine/verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`),
turning what it raises into a RewardError that names the function, the sample and the user's line.
The manager (verl.rewards.manager) runs these calls on threads; a worker process (verl.rewards.processes)
runs them with the same code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from verl.errors import ConfigError, RewardError
from verl.rewards.builtin import BATCHED_BUILTINS, BUILTIN_KWARG_CHECKS
from verl.rewards.loader import display_name, load_reward_function
from verl.rewards.spec import RewardFunctionSpec
from verl.utils.user_code import raised_at

VERL_SIGNATURE = ("data_source", "solution_str")
# TRL's reward functions are called with keywords only: prompts, completions, and every dataset column.
TRL_ARGUMENT = "completions"
# The column names the data layer reads a ground truth from (verl.data.fields; a test keeps them equal).
GROUND_TRUTH_NAMES = ("ground_truth", "answer", "label", "solution", "reference")
# The extra of a dict return that says whether the answer is correct (verl's math_dapo returns it as `acc`).
ACCURACY_KEY = "acc"


@dataclass
class LoadedFunction:
    """A reward function as loaded: its spec, its label in the metrics, where it was configured (for the
    messages) and what its signature takes."""

    spec: RewardFunctionSpec
    fn: Callable[..., Any]
    label: str
    where: str
    positional: tuple[str, ...]  # names of the first three parameters (prompt, response, ground_truth)
    keyword_names: frozenset[str] | None  # None: accepts **kwargs, so every metadata key is passed
    trl_style: bool = False  # TRL's `fn(completions, **kwargs)` over the batch (see RewardManager._call_trl)
    named: bool = False  # loaded by the spec's name (a worker process loads it the same way), not a Python callable

    @property
    def verl_style(self) -> bool:
        """volcengine/verl's signature, `compute_score(data_source, solution_str, ground_truth, extra_info)`
        (batched: the plurals): called with the sample's data_source first, not its prompt."""
        return self.positional[:2] in (VERL_SIGNATURE, tuple(f"{n}s" for n in VERL_SIGNATURE))

    @functools.cached_property
    def parameters(self) -> Mapping[str, inspect.Parameter]:
        """The function's parameters, read once (a TRL-style call matches the rows' columns to them)."""
        return inspect.signature(self.fn).parameters

    def applies(self, data_source: str | None) -> bool:
        sources = self.spec.data_sources
        return sources is None or (data_source is not None and data_source in sources)


def _as_spec(spec: RewardFunctionSpec | Mapping[str, Any], i: int, key: str = "reward.functions") -> RewardFunctionSpec:
    if isinstance(spec, RewardFunctionSpec):
        return spec
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"{key}[{i}] is a {type(spec).__name__}; each entry must be a mapping "
            "like {name: numeric_match, weight: 1.0} (or, from Python, a function)."
        )
    try:
        return RewardFunctionSpec.model_validate(dict(spec))
    except ValidationError as e:
        problems = "; ".join(
            f"{key}[{i}].{'.'.join(str(p) for p in err['loc']) or '<entry>'}: {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(
            f"invalid reward function spec: {problems}. Allowed keys: name, weight, kwargs, "
            "data_sources, batched."
        ) from e


def _signature_info(fn: Callable[..., Any]) -> tuple[tuple[str, ...], frozenset[str] | None]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return (), None
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))[:3]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return positional, None
    names = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return positional, names - set(positional)


def takes_parameter(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn`'s signature names a parameter `name` (False where it has no readable signature)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _check_signature(loaded: LoadedFunction) -> None:
    spec = loaded.spec
    try:
        sig = inspect.signature(loaded.fn)
    except (TypeError, ValueError):
        return
    args: tuple[Any, ...] = ([], [], [], []) if spec.batched else (None, None, None)
    try:
        # Partial: a per-sample function may require parameters that each row's metadata supplies.
        sig.bind(*args, **spec.kwargs) if spec.batched else sig.bind_partial(*args, **spec.kwargs)
    except TypeError as e:
        call = (
            "fn(prompts, responses, ground_truths, metadatas, **kwargs)"
            if spec.batched
            else "fn(prompt, response, ground_truth, **metadata, **kwargs)"
        )
        raise RewardError(
            f"{loaded.where}: '{loaded.label}{sig}' cannot be called as {call} with kwargs "
            f"{sorted(spec.kwargs)}: {e}. Fix the function's parameters or the spec's kwargs"
            + ("" if spec.batched else " (set batched: true if it takes whole lists)")
            + "."
        ) from None


def load_function(raw: RewardFunctionSpec | Mapping[str, Any] | Callable[..., Any], i: int, key: str,
                  base_dir: str | Path | None, used: dict[str, int]) -> LoadedFunction:
    """Entry `i` of `key` (`reward.functions`): a spec loaded by name, or a Python callable; `used` counts the
    labels given so far (a second numeric_match is labelled numeric_match_2)."""
    if callable(raw) and not isinstance(raw, (Mapping, RewardFunctionSpec)):
        # A Python function passed directly (RLTrainer.from_pretrained(reward_fn=fn)): weight 1,
        # every sample, per-sample call; it is labelled by its __name__ in the metrics.
        # An object may carry its spec options (e.g. a reward model: weight, batched).
        label_name = getattr(raw, "__name__", None) or type(raw).__name__
        spec = RewardFunctionSpec(name=label_name, **getattr(raw, "reward_spec", {}))
        where = f"{key}[{i}] (callable {label_name!r})"
        fn, named = raw, False
    else:
        spec = _as_spec(raw, i, key)
        if spec.name in BATCHED_BUILTINS:
            spec = spec.model_copy(update={"batched": True})
        where = f"{key}[{i}] (name={spec.name!r})"
        fn, named = load_reward_function(spec.name, base_dir=base_dir, where=where), True
    check = BUILTIN_KWARG_CHECKS.get(spec.name)
    if check is not None:
        try:
            check(spec.kwargs)
        except ValueError as e:
            raise RewardError(f"{where}: {e}") from None
    base_label = display_name(spec.name)
    used[base_label] = used.get(base_label, 0) + 1
    label = base_label if used[base_label] == 1 else f"{base_label}_{used[base_label]}"
    return loaded_function(spec, fn, label, where, named=named)


def loaded_function(spec: RewardFunctionSpec, fn: Callable[..., Any], label: str, where: str, *,
                    named: bool = False) -> LoadedFunction:
    """`fn` with its signature read and checked against `spec` (a worker process rebuilds its copy here)."""
    positional, names = _signature_info(fn)
    trl_style = not spec.batched and takes_parameter(fn, TRL_ARGUMENT)  # `batched: true` keeps our list convention
    loaded = LoadedFunction(spec, fn, label, where, positional, names, trl_style=trl_style, named=named)
    if not loaded.trl_style:  # a TRL function's keywords depend on the rows, checked when called
        _check_signature(loaded)
    return loaded


def call_one(ld: LoadedFunction, i: int, prompt: Any, response: str, ground_truth: Any, meta: dict[str, Any],
             data_source: str | None) -> Any:
    """`ld` on sample `i`: the metadata keys its signature takes, then the spec's kwargs; what it raises comes
    back as a RewardError naming the function, the sample and the user's line."""
    kwargs = {k: v for k, v in meta.items()
              if k not in ld.positional and (ld.keyword_names is None or k in ld.keyword_names)}
    if "data_source" in ld.parameters and "data_source" not in (*kwargs, *ld.positional):  # declared by name
        kwargs["data_source"] = data_source
    kwargs.update(ld.spec.kwargs)
    try:
        return ld.fn(data_source if ld.verl_style else prompt, response, ground_truth, **kwargs)
    except Exception as e:
        hint = (" If a parameter is missing, add that key to every row's metadata; if the function takes whole "
                "lists, set batched: true in its spec." if isinstance(e, TypeError) else thread_hint(e))
        raise RewardError(
            f"reward function '{ld.label}' ({ld.where}) raised {type(e).__name__}: {e} on sample {i} "
            f"(data_source={data_source!r}, ground_truth={short_repr(ground_truth)}, "
            f"response={short_repr(response)}){at_user_line(e)}. Fix the function or that row.{hint}"
        ) from e


def at_user_line(exc: BaseException) -> str:
    """`, at File "r.py", line 3, in fn: <its text>`: the user's own line, so the message replaces the
    traceback (still chained, for a debugger)."""
    where = raised_at(exc)
    return f",\n  at {where}" if where else ""


def thread_hint(exc: BaseException) -> str:
    """Reward calls run on worker threads (`RewardPool`), where `signal` (a SIGALRM timeout) is refused."""
    if isinstance(exc, ValueError) and "main thread" in str(exc):
        return (" Reward functions run on worker threads (reward.workers), where signal handlers cannot be set: "
                "drop the function's own signal-based timeout (reward.timeout_s already bounds every call).")
    return ""


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["ACCURACY_KEY", "GROUND_TRUTH_NAMES", "LoadedFunction", "at_user_line", "call_one", "load_function",
           "loaded_function", "short_repr", "takes_parameter", "thread_hint"]
