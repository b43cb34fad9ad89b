"""`verl eval`: a model or checkpoint answers a dataset n times per prompt; pass@k, maj@k, mean@k.

It is the trainer's own validation (`RLTrainer.evaluate` -> `evaluation.evaluate_rows`) on a run built for
it: the same composition (`components.compose`: checks, tokenizer, policy, rollout engine, environment and
reward functions), the same prompt encoding, sampling stream and scoring, so a checkpoint evaluated with its
run's config and validation rows gives the numbers the run logged at that step. Only what sampling needs is
built: no reference, critic or teacher (the run's shape is forced to one process, one prompt per step).

What is evaluated (`resolve_source`): a verl checkpoint (`<run>/checkpoints/step_N`, verified before it is
read; its run's config is the starting point), a run folder (its best checkpoint when `checkpoint.keep_best`
marked one, else `latest`), or anything `model.path` takes (a Hugging Face folder or hub id, `tiny`).
The rows: `data` (files the data layer reads, with its row report), else the config's validation rows
(the built-in arithmetic environment's when there is no config).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from verl.checkpoint import list_checkpoints, load_checkpoint, verify
from verl.checkpoint.best import read_best
from verl.checkpoint.manager import CHECKPOINTS_DIR, extra_file, read_latest
from verl.checkpoint.manifest import MANIFEST_NAME, read_manifest
from verl.config.loader import apply_overrides, build_config, read_yaml, set_dotted
from verl.config.schema import RunConfig
from verl.errors import CheckpointError, ConfigError
from verl.trainer.rl.evaluation import check_ks, validation_ks


@dataclass
class EvalSource:
    """What `verl eval MODEL` names: a model path, or a checkpoint with the config of its run."""

    model: str
    checkpoint: Path | None = None
    step: int | None = None
    config_yaml: str | None = None
    note: str = ""  # how a run folder was resolved to a checkpoint


@dataclass
class EvalResult:
    """What `verl eval` writes as JSON (`to_dict`) and prints as a table."""

    model: str
    checkpoint: str | None
    step: int | None
    data: str
    rows: int
    n: int
    k: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    metrics: dict[str, float]
    by_data_source: dict[str, dict[str, float]]
    source_rows: dict[str, int]
    data_report: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _checkpoint_of_run(path: Path) -> tuple[Path, str]:
    """The checkpoint a run folder (or its checkpoints folder) stands for: best, else latest, else newest."""
    root = path if path.name == CHECKPOINTS_DIR else path / CHECKPOINTS_DIR
    best = read_best(root)
    if best is not None and (root / best.folder).is_dir():
        return root / best.folder, f"the run's best checkpoint ({best.folder}, {best.describe()})"
    latest = read_latest(root)
    if latest is not None and (root / latest).is_dir():
        return root / latest, f"the run's latest checkpoint ({latest})"
    steps = list_checkpoints(root, verify_files=False)
    if not steps:
        raise CheckpointError(f"{path}: a run folder without checkpoints (nothing under {root}). Fix: pass a "
                              "checkpoint folder (<run>/checkpoints/step_N), a Hugging Face model folder or a hub id")
    return steps[-1].path, f"the run's newest checkpoint ({steps[-1].path.name})"


def resolve_source(model: str) -> EvalSource:
    """A checkpoint (verified: every file against its manifest), a run folder's checkpoint, or a model path."""
    path = Path(model).expanduser()
    note = ""
    if path.is_dir() and not (path / MANIFEST_NAME).is_file() and (
            path.name == CHECKPOINTS_DIR or (path / CHECKPOINTS_DIR).is_dir()):
        path, note = _checkpoint_of_run(path)
    if not (path / MANIFEST_NAME).is_file():
        return EvalSource(model=model)
    problems = verify(path)
    if problems:
        raise CheckpointError(f"{path}: refusing to evaluate a checkpoint that does not verify:\n  "
                              + "\n  ".join(problems)
                              + "\nUse another checkpoint (`verl ckpt list` shows which verify)")
    extra = torch.load(path / extra_file(0), weights_only=True, map_location="cpu")
    saved = extra.get("config_yaml") if isinstance(extra, dict) else None
    if not saved:
        raise CheckpointError(f"{path / extra_file(0)}: holds no config_yaml, so the model it was trained from is "
                              "unknown. Fix: `verl ckpt export` it to a Hugging Face folder and evaluate that")
    return EvalSource(model=str(path), checkpoint=path, step=int(read_manifest(path)["step"]), config_yaml=saved,
                      note=note)


# The run shape evaluation needs, over any config: one process, one prompt per (never taken) step, the
# policy alone (no reference, critic or teacher), no run folder read or written.
def _eval_shape(tree: dict[str, Any], *, data: str | None) -> None:
    for key, value in {"trainer.kind": "rl", "trainer.val_only": False, "trainer.resume": "never",
                       "trainer.demo": None, "trainer.val_before_train": False, "data.kind": "prompt",
                       "data.train_batch_size": 1, "actor.mini_batch_size": None, "critic.mini_batch_size": None,
                       "actor.kl_loss_coef": 0.0, "algorithm.kl_in_reward": False,
                       "algorithm.filter_groups": False, "algorithm.distill.teacher_path": None,
                       "checkpoint.keep_best": None, "logging.backends": ["console"]}.items():
        set_dotted(tree, key, value)
    for role in ("actor", "critic", "ref", "reward", "teacher", "rollout"):
        set_dotted(tree, f"devices.{role}", None)
    if data is not None:  # the rows are read once, as training rows (in file order, with the row report)
        for key, value in {"env.name": None, "env.kwargs": {}, "data.train_files": [data], "data.val_files": [],
                           "data.val_size": 0}.items():
            set_dotted(tree, key, value)


def eval_config(source: EvalSource, data: str | None = None, overrides: Sequence[str] = (), *,
                config_path: str | None = None, n: int | None = None, ks: Sequence[int] | None = None,
                temperature: float | None = None, batch_size: int | None = None) -> tuple[RunConfig, list[str]]:
    """The run to evaluate with, and notes for the user. Starting point: the checkpoint's run config, else
    `config_path`, else the defaults (the arithmetic environment when no data is given); then `overrides`
    (`key=value`), then n / k / temperature (`rollout.val_n`, `val_k`, `val_temperature`)."""
    notes: list[str] = []
    if source.config_yaml is not None:
        tree = yaml.safe_load(source.config_yaml) or {}
        if config_path is not None:
            notes.append(f"--config {config_path}: ignored; a checkpoint is evaluated with its run's config "
                         "(change keys with key=value)")
    else:
        tree = read_yaml(config_path) if config_path is not None else {}
        set_dotted(tree, "model.path", source.model)
        if config_path is None and data is None:
            set_dotted(tree, "env.name", "arithmetic")
    problems = apply_overrides(tree, list(overrides))
    if problems:
        raise ConfigError("verl eval: " + "; ".join(problems))
    rollout = tree.setdefault("rollout", {})
    if n is not None:
        rollout["val_n"] = n
    if ks is not None:
        rollout["val_k"] = list(ks)
    if temperature is not None:
        rollout["val_temperature"] = temperature
    if batch_size is not None:
        set_dotted(tree, "data.val_batch_size", batch_size)
    _eval_shape(tree, data=data)
    config = build_config(copy.deepcopy(tree), source="verl eval")
    r = config.rollout
    check_ks(r.val_n, r.val_k, n_key="--n (rollout.val_n)", k_key="--k (rollout.val_k)")
    if r.val_n > 1 and r.val_temperature == 0:
        notes.append(f"n={r.val_n} greedy answers would all be the same: sampling at temperature 1.0 (set "
                     "--temperature to choose)")
        r.val_temperature = 1.0
    if config.needs_critic:  # PPO's critic only shapes training; sampling needs the policy alone
        config.algorithm.adv_estimator = "reinforce_pp"
    return config, notes


def run_eval(config: RunConfig, source: EvalSource, *, data: str | None = None, notes: Sequence[str] = (),
             on_start: Callable[[int, Any], None] | None = None,
             progress: Callable[[int], None] | None = None) -> EvalResult:
    """Build the run, put the checkpoint's weights in, answer the rows; `on_start(rows, data report)` once
    the rows are known, `progress(rows done)` after each chunk."""
    from verl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer(config)
    if source.checkpoint is not None:
        load_checkpoint(source.checkpoint, app_state={"model": trainer.model})
        trainer.step_count = source.step or 0  # the validation stream of that step: the numbers the run logged
    report = None
    if data is not None:
        rows = list(trainer.checks.data.train or [])
        report = trainer.checks.data.reports.get("train")
    else:
        rows = list(trainer.env.val_rows())
        if not rows:
            raise ConfigError(f"{source.model}: its config has no validation rows (no data.val_files, data.val_size "
                              "or environment validation set). Fix: pass a DATA file: verl eval MODEL DATA")
    if on_start is not None:
        on_start(len(rows), report)
    grouped: dict[str, Any] = {}
    r = config.rollout
    trainer.evaluate(rows, prefix="eval", progress=progress, report=grouped)
    where = data if data is not None else (f"env {config.env.name}: validation set" if config.env.name
                                           else "the config's validation rows")
    return EvalResult(model=config.model.path, checkpoint=None if source.checkpoint is None else str(source.checkpoint),
                      step=source.step, data=where, rows=len(rows), n=r.val_n, k=validation_ks(r.val_n, r.val_k),
                      temperature=r.val_temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                      seed=config.trainer.seed, metrics=grouped["overall"], by_data_source=grouped["by_data_source"],
                      source_rows=dict(Counter(str(row.get("data_source")) for row in rows)),
                      data_report=None if report is None else report.to_dict(),
                      notes=[*([source.note] if source.note else []), *notes])


__all__ = ["EvalResult", "EvalSource", "eval_config", "resolve_source", "run_eval"]
