"""The start-up pass: every check `verl check` runs is the one the trainer runs before training.

`preflight()` collects problems instead of raising them, section by section, cheapest first:

1. start-up (no weights): model path spec, device mapping, batch arithmetic, FSDP rules, memory estimate;
2. model and tokenizer: the policy loaded as training loads it (skipped when step 1 found problems, so
   a config that cannot run fails in seconds);
3. data: the training/validation files read with the trainer's tokenizer, prompt limit and truncation;
4. environment and rewards (RL): the environment and the reward functions built from the config.

The trainer keeps what the pass loaded (model, tokenizer, rows, environment) instead of loading it again,
and raises `Preflight.raise_if_problems()`; `verl check` prints the same `Preflight`. Nothing here prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.env import build_env
from verl.errors import ModelError, VerlError
from verl.rewards import RewardManager
from verl.trainer.data_split import DATA_KINDS, DataSplit, split_train_val
from verl.trainer.models import given_policy, load_policy_with_report, resolve_model_path
from verl.trainer.setup import run_dtype
from verl.trainer.startup import StartupReport, check_startup


@dataclass(frozen=True)
class Problem:
    """One thing that would stop the run: the section that found it and the error (what, where, fix)."""

    section: str  # "start-up", "model", "data", "environment" or "rewards"
    error: VerlError

    @property
    def message(self) -> str:
        return str(self.error)

    def __str__(self) -> str:
        return f"[{self.section}] {self.message}"


@dataclass(frozen=True)
class Given:
    """What a Python caller passed in place of the config; those parts are not built from the config."""

    model: Any = None
    tokenizer: Any = None
    rows: bool = False  # training rows in memory (RL prompts, SFT/DPO train_rows)
    val_rows: bool = False
    env: bool = False
    reward_functions: bool = False


@dataclass
class Preflight:
    """Everything the start-up pass found and loaded."""

    config: RunConfig
    world_size: int
    kind: str  # the trainer that will run: rl, sft or dpo
    model_path: str | None = None
    startup: StartupReport | None = None
    problems: list[Problem] = field(default_factory=list)
    model: Any = None
    tokenizer: Any = None
    model_report: Any = None
    data: DataSplit | None = None
    env: Any = None
    reward_names: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # section -> why it did not run

    @property
    def data_kind(self) -> str:
        return DATA_KINDS[self.kind]

    @property
    def messages(self) -> list[str]:
        return [str(p) for p in self.problems]

    def take(self, name: str) -> Any:
        """Hand a loaded object (model, data, env) to the trainer and drop this reference to it, so a
        rank that discards it (a critic-only rank drops the policy) really frees it."""
        value = getattr(self, name)
        setattr(self, name, None)
        return value

    def add(self, section: str, error: VerlError) -> None:
        self.problems.append(Problem(section, error))

    def raise_if_problems(self) -> None:
        """Raise one error listing every problem, of the first problem's class (the cheapest section's,
        the one to fix first; a ConfigError for a config mistake), so callers can still catch by kind."""
        if not self.problems:
            return
        nothing = " (nothing was loaded)" if self.model is None else ""
        text = (f"start-up checks failed{nothing}; `verl check CONFIG` lists the same "
                f"{len(self.problems)} problem(s):\n\n" + "\n\n".join(self.messages))
        error = type(self.problems[0].error)(text)
        error.problems = self.messages  # the list `verl check` prints, for callers that compare
        raise error


Prepare = Callable[[StartupReport], tuple[torch.device, torch.dtype]]


def preflight(config: RunConfig, *, world_size: int, device_type: str, kind: str | None = None,
              runs_split_placements: bool | None = None, given: Given = Given(),
              prepare: Prepare | None = None) -> Preflight:
    """Run every start-up check for `config` on `world_size` processes; the checks never raise, their
    problems are in the returned `Preflight`.

    `prepare` runs once the weight-free checks pass, before anything loads, and returns the device and
    dtype to load in (the trainer joins its process group there); without it the model loads on
    `device_type` in the dtype a run would use.
    """
    pf = Preflight(config=config, world_size=world_size, kind=kind or config.trainer.kind)
    try:
        pf.model_path = resolve_model_path(config.model.path)
    except VerlError as exc:
        pf.add("start-up", exc)
    pf.startup = check_startup(config, world_size=world_size, model_path=pf.model_path, device_type=device_type,
                               kind=pf.kind, runs_split_placements=runs_split_placements)
    for exc in pf.startup.problems:
        pf.add("start-up", exc)
    if pf.problems:
        pf.skipped["model"] = "the start-up problems come first: nothing was loaded"
    else:
        if prepare is not None:
            device, dtype = prepare(pf.startup)
        else:
            device, dtype = torch.device(device_type), run_dtype(config.model.dtype, device_type)
        _model_pass(pf, given, device, dtype)
    _data_pass(pf, given)
    _env_pass(pf, given)
    return pf


def _model_pass(pf: Preflight, given: Given, device: torch.device, dtype: torch.dtype) -> None:
    if given.model is not None:
        try:
            pf.model, pf.tokenizer = given_policy(given.model, given.tokenizer, device, pf.config)
        except VerlError as exc:
            pf.add("model", exc)
        return
    path = pf.model_path
    if not Path(path).expanduser().exists() and path.startswith(("/", ".", "~")):
        pf.add("model", ModelError(
            f"model.path={path} does not exist on this machine; download the model there or fix the path "
            "(everything else was checked without it)"))
        return
    try:
        pf.model, pf.tokenizer, pf.model_report = load_policy_with_report(pf.config, path, device=device, dtype=dtype)
        pf.model_report.raise_if_problems()
    except VerlError as exc:
        pf.add("model", exc)


def _data_pass(pf: Preflight, given: Given) -> None:
    config = pf.config
    if given.rows or (pf.kind == "rl" and given.env):
        pf.skipped["data"] = "the training prompts were passed in from Python"
        return
    if pf.kind == "rl" and config.env.name is not None:
        pf.skipped["data"] = f"env.name={config.env.name!r} makes its own prompts"
        return
    if pf.tokenizer is None:
        pf.skipped["prompt lengths"] = "no tokenizer was loaded, so prompt lengths were not checked"
    pf.data = split_train_val(config, pf.data_kind, pf.tokenizer)
    for exc in pf.data.problems:
        pf.add("data", exc)


def _env_pass(pf: Preflight, given: Given) -> None:
    config = pf.config
    if pf.kind != "rl" or given.env or given.reward_functions:
        return
    common = {"base_dir": config._source_dir, "seed": config.trainer.seed, "shuffle": config.data.shuffle}
    if config.env.name is not None:
        try:
            pf.env = build_env(config.env, reward_functions=config.reward.functions, **common)
        except VerlError as exc:
            pf.add("environment", exc)
        return
    if config.reward.functions or not config.reward.model_path:  # a reward model alone is a reward
        try:
            pf.reward_names = list(RewardManager(config.reward.functions, base_dir=config._source_dir).names)
        except VerlError as exc:
            pf.add("rewards", exc)
            return
    if config.reward.model_path or given.rows or pf.data is None or pf.data.problems:
        return  # the trainer builds it (with the reward model's scorer, or the rows passed in)
    try:
        pf.env = build_env(config.env, reward_functions=config.reward.functions, train_rows=pf.data.train,
                           val_rows=pf.data.val, **common)
    except VerlError as exc:
        pf.add("environment", exc)


__all__ = ["Given", "Preflight", "Problem", "preflight"]
