"""The check pass: every check `verl check` runs is the one the trainer runs before anything loads.

`preflight()` collects problems instead of raising them, section by section, cheapest first:

1. start-up (no weights): model path spec, hub ids neither cached nor reachable, device mapping, batch
   arithmetic, FSDP rules, memory estimate, a stale `latest` checkpoint pointer;
2. tokenizer: loaded once (the trainer keeps it); a `model.tokenizer_path` whose vocabulary differs from
   the model's own tokenizer is refused unless `model.allow_tokenizer_mismatch` (then a warning);
3. model: the policy built by the loader training uses, but on the meta device, with every model and
   tokenizer check; no weight is read (so `verl check`, `verl train --nproc` before its workers start,
   and each trainer before it joins a process group all find the same problems);
4. data: the training/validation files read with the trainer's tokenizer, prompt limit and truncation
   (or prompt rows passed in from Python, through the same aliases); at least one full batch;
5. environment and rewards (RL): the environment and the reward functions built from the config, with
   every row lacking the ground truth a configured reward needs (file:line).

`components.compose` raises the problems and builds on what this pass made (tokenizer, rows,
environment); `verl check` prints the same `Preflight`. Nothing here prints or loads weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.data.split import DATA_KINDS, DataSplit, canonical_rows, split_train_val
from verl.data.tool_template import chat_template_text
from verl.env import build_env
from verl.env.base import Environment, check_ground_truths
from verl.env.multiturn import MultiTurnEnvironment, is_multiturn
from verl.errors import ConfigError, DataError, ModelError, RewardError, VerlError
from verl.models.checks import vocabulary_difference
from verl.models.hf_loader import load_tokenizer
from verl.models.reward_model import saved_head_problem
from verl.models.tiny import is_tiny_spec
from verl.rewards import RewardManager
from verl.trainer.build.models import (
    describe_cpu_matmul,
    load_policy_with_report,
    resolve_model_path,
    tokenizer_mismatch_message,
)
from verl.trainer.build.setup import run_dtype
from verl.trainer.checks.source_checks import check_model_sources, model_sources
from verl.trainer.checks.startup import VAL_ONLY_NEEDS_ROWS, StartupReport, check_env_options, check_startup
from verl.utils.tokenizer_protocol import Tokenizer


@dataclass(frozen=True)
class Problem:
    """One thing that would stop the run: the section that found it and the error (what, where, fix)."""

    section: str  # "start-up", "model", "data", "environment" or "rewards" (a tokenizer mismatch: "model")
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
    tokenizer: Tokenizer | None = None
    rows: Sequence[Any] | None = None  # training rows in memory (RL prompts, SFT/DPO train_rows or examples)
    val_rows: Sequence[Any] | None = None
    env: Environment | MultiTurnEnvironment | None = None
    reward_functions: Sequence[Any] | None = None


@dataclass
class Preflight:
    """Everything the start-up pass found and loaded."""

    config: RunConfig
    world_size: int
    kind: str  # the trainer that will run: rl, sft or dpo
    model_path: str | None = None
    startup: StartupReport | None = None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)  # worth a look, but the run can start
    tokenizer: Tokenizer | None = None
    model_report: Any = None  # the meta-device model check (`check_model`)
    cpu_matmul: str | None = None  # what trainer.cpu_matmul means for this run's policy on CPU, and why
    data: DataSplit | None = None
    given_rows: Sequence[dict[str, Any]] | None = None  # RL prompt rows passed in, in canonical form
    env: Environment | MultiTurnEnvironment | None = None
    reward_names: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # section -> why it did not run

    @property
    def data_kind(self) -> str:
        return DATA_KINDS[self.kind]

    @property
    def messages(self) -> list[str]:
        return [str(p) for p in self.problems]

    def add(self, section: str, error: VerlError) -> None:
        self.problems.append(Problem(section, error))

    def warn(self, section: str, error: VerlError) -> None:
        self.warnings.append(Problem(section, error))

    def raise_if_problems(self) -> None:
        """Raise one error listing every problem, of the first problem's class (the cheapest section's,
        the one to fix first; a ConfigError for a config mistake), so callers can still catch by kind."""
        if not self.problems:
            return
        text = ("start-up checks failed (nothing was loaded); `verl check CONFIG` lists the same "
                f"{len(self.problems)} problem(s):\n\n" + "\n\n".join(self.messages))
        error = type(self.problems[0].error)(text)
        error.problems = self.messages  # the list `verl check` prints, for callers that compare
        raise error


def preflight(config: RunConfig, *, world_size: int, device_type: str, kind: str | None = None,
              runs_split_placements: bool | None = None, given: Given = Given(),
              check_model: bool = True, nodes: int | None = None) -> Preflight:
    """Run every start-up check for `config` on `world_size` processes (over `nodes` nodes: the launch's
    `--nnodes`; None reads it from torchrun's environment); the checks never raise, their
    problems are in the returned `Preflight`. No weight is read: with `check_model` the policy is built on
    the meta device for the model/tokenizer checks (the trainer runs those on its real load instead).
    """
    pf = Preflight(config=config, world_size=world_size, kind=kind or config.trainer.kind)
    try:
        pf.model_path = resolve_model_path(config.model.path)
    except VerlError as exc:
        pf.add("start-up", exc)
    source_problems, source_warnings = check_model_sources(config, pf.kind, policy_given=given.model is not None)
    for exc in source_problems:
        pf.add("start-up", exc)
    for exc in source_warnings:
        pf.warn("start-up", exc)
    pf.startup = check_startup(config, world_size=world_size, model_path=pf.model_path, device_type=device_type,
                               kind=pf.kind, runs_split_placements=runs_split_placements, nodes=nodes)
    for exc in pf.startup.problems:
        pf.add("start-up", exc)
    if pf.problems:
        pf.skipped["model"] = "the start-up problems come first: nothing was loaded"
    else:
        _tokenizer_pass(pf, given)
        _frozen_tokenizers_pass(pf)
        _reward_model_pass(pf)
        if check_model and not pf.problems:
            _model_pass(pf, given, torch.device(device_type), run_dtype(config.model.dtype, device_type))
    _data_pass(pf, given)
    _env_pass(pf, given)
    _batch_pass(pf)
    _val_only_pass(pf)
    return pf


def _tokenizer_pass(pf: Preflight, given: Given) -> None:
    """Load the tokenizer once (the trainer keeps it) and compare a `model.tokenizer_path` with the model's
    own tokenizer, vocabulary against vocabulary, before any weights load."""
    cfg = pf.config.model
    if given.model is not None or given.tokenizer is not None:
        pf.tokenizer = given.tokenizer
        return
    if pf.model_path is None:
        return
    path = pf.model_path
    if not Path(path).expanduser().exists() and path.startswith(("/", ".", "~")):
        pf.add("model", ModelError(f"model.path={path} does not exist on this machine; download the model "
                                   "there or fix the path (everything else was checked without it)"))
        return
    source = cfg.tokenizer_path or path
    try:
        pf.tokenizer = load_tokenizer(source, revision=cfg.revision if cfg.tokenizer_path is None else None,
                                      trust_remote_code=cfg.trust_remote_code)
    except VerlError as exc:
        pf.add("model", ModelError(f"model.tokenizer_path={source}: {exc}" if cfg.tokenizer_path
                                   else f"model.path={source}: {exc}"))
        return
    if cfg.chat_template is not None:
        try:
            pf.tokenizer.chat_template = chat_template_text(cfg.chat_template, pf.config._source_dir)
        except VerlError as exc:
            pf.add("model", exc)
            return
    if cfg.tokenizer_path is None or Path(cfg.tokenizer_path).expanduser() == Path(path).expanduser():
        return
    try:
        own = load_tokenizer(path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except VerlError:
        return  # weights-only folder: nothing to compare against
    mismatch = vocabulary_difference(pf.tokenizer, own)
    if mismatch is None:
        return
    text = (f"model.tokenizer_path={cfg.tokenizer_path} has a different vocabulary from the tokenizer of "
            f"model.path={cfg.path}: {mismatch}. Token ids would index the wrong embedding rows")
    if cfg.allow_tokenizer_mismatch:
        pf.warn("model", ModelError(f"{text}; allowed by model.allow_tokenizer_mismatch=true."))
    else:
        pf.add("model", ModelError(
            f"{text}. Fix: remove model.tokenizer_path to use the model's own tokenizer, or, if the model's "
            "embeddings were trained for this tokenizer, set model.allow_tokenizer_mismatch=true."))


def _frozen_tokenizers_pass(pf: Preflight) -> None:
    """A reference (`ref.path`) or distillation teacher with another vocabulary than the policy's scores
    other tokens than the ones sampled: refused here, from the tokenizers alone, before any weight loads."""
    config = pf.config
    sources = {key: path for key, path in model_sources(config, pf.kind).items()
               if key in ("ref.path", "algorithm.distill.teacher_path")}
    if pf.tokenizer is None or not sources:
        return
    for key, path in sources.items():
        try:
            theirs = load_tokenizer(resolve_model_path(path, key=key), trust_remote_code=config.model.trust_remote_code)
        except VerlError as exc:
            pf.add("model", ModelError(f"{key}={path}: {exc}"))
            continue
        mismatch = vocabulary_difference(theirs, pf.tokenizer, names=(key, "model.path"))
        if mismatch is not None:
            pf.add("model", ModelError(tokenizer_mismatch_message(key, path, config.model.path, mismatch)))


def _reward_model_pass(pf: Preflight) -> None:
    """A `reward.model_path` folder whose weights hold no score head would score noise: refused from the
    safetensors' names alone, before anything loads (the loader refuses it too, for other weight formats)."""
    path = pf.config.reward.model_path
    if pf.kind != "rl" or not path or is_tiny_spec(path):
        return
    problem = saved_head_problem(path)  # read as the scorer loads it: a folder here, else a hub id
    if problem is not None:
        pf.add("model", ModelError(problem))


def _batch_pass(pf: Preflight) -> None:
    """At least one full batch of training rows: RL draws `data.train_batch_size` distinct prompts per
    step; SFT/DPO batches run across epoch ends, so a larger batch only repeats rows (a warning)."""
    if pf.kind == "rl":
        rows = len(pf.env) if pf.env is not None else (len(pf.data.train) if pf.data and pf.data.train else None)
    else:
        rows = len(pf.data.train) if pf.data is not None and pf.data.train is not None else None
    if not rows:
        return
    config = pf.config
    key, size = ("sft.batch_size", config.sft.batch_size) if pf.kind == "sft" else (
        "data.train_batch_size", config.data.train_batch_size)
    if rows >= size:
        return
    what = {"rl": "prompts", "sft": "examples", "dpo": "preference pairs", "rm": "preference pairs"}[pf.kind]
    files = (", ".join(config.data.train_files) or
             (f"data.mixture ({', '.join(str(m.name) for m in config.data.mixture)})" if config.data.mixture else "")
             or "the training rows")
    text = (f"{key}={size} {what} per step, but {files} has only {rows} training {what} after the data checks"
            f"{' and data.val_size' if config.data.val_size and not config.data.val_files else ''}")
    if pf.kind == "rl":
        pf.add("data", ConfigError(f"{text}, so not even one batch of distinct prompts exists. Fix: set "
                                   f"{key}={rows} or lower, or add data."))
    else:
        pf.warn("data", DataError(f"{text}, so each step repeats rows. Fix: set {key}={rows} or lower, or "
                                  "add data."))


def _val_only_pass(pf: Preflight) -> None:
    """`trainer.val_only` needs held-out rows: refused with the other start-up problems when there are none."""
    if not pf.config.trainer.val_only:
        return
    if pf.env is not None:
        rows = len(pf.env.val_rows())
    elif pf.data is not None and not pf.data.problems:
        rows = len(pf.data.val or [])
    else:
        return
    if rows == 0:
        pf.add("data", ConfigError(VAL_ONLY_NEEDS_ROWS))


def _model_pass(pf: Preflight, given: Given, device: torch.device, dtype: torch.dtype) -> None:
    """The policy as training builds it, on the meta device: every model/tokenizer check, no weights."""
    if given.model is not None or pf.tokenizer is None:
        return  # a model object passed in is checked as it is handed over; no tokenizer: reported above
    try:
        model, _, pf.model_report = load_policy_with_report(pf.config, pf.model_path, device=device, dtype=dtype,
                                                            tokenizer=pf.tokenizer, weights=False,
                                                            reward_head=pf.kind == "rm")
    except VerlError as exc:
        pf.add("model", exc)
        return
    pf.cpu_matmul = describe_cpu_matmul(pf.config, model) if device.type == "cpu" else None
    for problem in pf.model_report.problems:
        pf.add("model", ModelError(problem))
    for warning in pf.model_report.warnings:
        pf.warn("model", ModelError(warning))


def _data_pass(pf: Preflight, given: Given) -> None:
    config = pf.config
    if pf.kind == "rl" and given.rows is not None and given.env is None:
        try:
            pf.given_rows = canonical_rows(given.rows, config, pf.tokenizer)
        except VerlError as exc:
            pf.add("data", exc)
        pf.skipped["data"] = "the training prompts were passed in from Python"
        return
    if given.rows is not None or (pf.kind == "rl" and given.env is not None):
        pf.skipped["data"] = "the training rows were passed in from Python"
        return
    if pf.kind == "rl" and config.env.name is not None:
        pf.skipped["data"] = f"env.name={config.env.name!r} makes its own prompts"
        return
    if pf.tokenizer is None:
        pf.skipped["prompt lengths"] = "no tokenizer was loaded, so prompt lengths were not checked"
    pf.data = split_train_val(config, pf.data_kind, pf.tokenizer)
    for exc in pf.data.problems:
        pf.add("data", exc)


def validation_rewards(config: RunConfig, env: Environment | MultiTurnEnvironment) -> RewardManager | None:
    """`reward.val_functions` as the reward manager validation scores with (None: as training scores), checked
    against the environment's held-out rows (a function that needs a ground truth a row lacks, file:line)."""
    if not config.reward.val_functions:
        return None
    if config.env.agent is not None or is_multiturn(env):
        raise ConfigError("reward.val_functions scores single responses, but this environment runs multi-turn "
                          "episodes that it scores itself. Fix: remove reward.val_functions")
    r = config.reward
    manager = RewardManager(r.val_functions, base_dir=config._source_dir, workers=r.workers, timeout_s=r.timeout_s,
                            key="reward.val_functions")
    if env is not None and callable(getattr(env, "val_rows", None)):
        rows = env.val_rows()
        try:
            manager.check_data_sources([row.get("data_source") for row in rows])
        except RewardError as exc:
            raise RewardError(f"reward.val_functions: val data: {exc}") from None
        check_ground_truths(manager, rows, "val")
    return manager


def _env_pass(pf: Preflight, given: Given) -> None:
    """Build the environment when no weights are needed for it (a local reward model is one more reward
    function: `components.setup_env` builds that environment once the model is loaded)."""
    config = pf.config
    if pf.kind != "rl" or given.env is not None:
        return
    try:
        validation_rewards(config, None)  # the functions load; the rows are checked once the env is built
    except VerlError as exc:
        pf.add("rewards", exc)
    common = {"base_dir": config._source_dir, "seed": config.trainer.seed, "shuffle": config.data.shuffle}
    functions = list(given.reward_functions) if given.reward_functions is not None else config.reward.functions
    if config.env.name is not None:
        try:
            pf.env = build_env(config.env, reward_functions=functions, **common)
        except VerlError as exc:
            pf.add("environment", exc)
        for exc in check_env_options(config, pf.env, pf.tokenizer) if pf.env is not None else []:
            pf.add("environment", exc)
        return
    if given.reward_functions is None and (config.reward.functions or not (config.reward.model_path
                                                                            or config.env.agent)):
        try:  # a reward model alone is a reward
            pf.reward_names = RewardManager(config.reward.functions, base_dir=config._source_dir).described
        except VerlError as exc:
            pf.add("rewards", exc)
            return
    rows = (pf.given_rows, []) if pf.given_rows is not None else (
        (pf.data.train, pf.data.val) if pf.data is not None and not pf.data.problems else None)
    if config.reward.model_path or rows is None:
        return
    try:
        pf.env = build_env(config.env, reward_functions=functions, train_rows=rows[0], val_rows=rows[1],
                           rewards_optional=config.env.agent is not None, **common)
    except VerlError as exc:
        pf.add("environment", exc)


__all__ = ["Given", "Preflight", "Problem", "preflight", "validation_rewards"]
