"""The training loop every trainer shares: resume, validate, step, log, checkpoint, stop on a signal.

Rank 0 tells the user what is happening: a banner (model, rows, run directory, what it resumes from and
which config keys changed since), progress and metrics through the `Tracker`, validation samples, and on
SIGINT/SIGTERM where it stopped (`TrainingInterrupted`, after saving).

It only calls the trainer's `step()`, `validate()` and its state hooks (`app_state()`, `trainer_state()`,
`load_trainer_state()`, `schedulers()`, `hf_assets()`), so RL, SFT and DPO resume the same way.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml
from torch.optim.optimizer import register_optimizer_step_pre_hook

from verl.checkpoint import (
    GracefulStop,
    TrainingInterrupted,
    capture_rng_state,
    restore_rng_state,
)
from verl.config.loader import config_to_yaml
from verl.config.schema import RunConfig
from verl.distributed import heartbeat
from verl.errors import CheckpointError, ConfigError, VerlError
from verl.tracking.summary import run_summary_lines
from verl.trainer.build.models import describe_cpu_matmul
from verl.trainer.checks.startup import VAL_ONLY_NEEDS_ROWS, check_sandbox
from verl.trainer.compose.components import Components, setup_checkpoints, setup_tracker
from verl.trainer.compose.keep_best import KeepBest, StopRule
from verl.trainer.rl import signal_watch
from verl.utils.cpu_matmul import describe

# The extra-state key of a checkpoint that trainer.stop_when saved as the run's end (its value: the rule).
STOPPED_KEY = "stop_when_reached"


class Trainer(Protocol):
    """What the loop uses of a trainer (`TrainerRuntime` and its subclasses provide it)."""

    config: RunConfig
    rank: int
    world_size: int
    run_dir: Path
    device: torch.device
    step_count: int
    history: list[dict[str, float]]
    generator: torch.Generator
    shuffle_generator: torch.Generator
    model: torch.nn.Module | None
    parts: Components
    validation_samples: list[dict[str, Any]] | None

    def step(self) -> dict[str, float]: ...
    def validate(self) -> dict[str, float]: ...
    def row_counts(self) -> tuple[int, int] | None: ...
    def app_state(self) -> dict[str, Any]: ...
    def trainer_state(self) -> dict[str, Any]: ...
    def load_trainer_state(self, state: Mapping[str, Any]) -> None: ...
    def schedulers(self) -> dict[str, Any]: ...
    def hf_assets(self) -> tuple[Any, ...]: ...


def extra_state(trainer: Trainer) -> dict[str, Any]:
    """What a checkpoint needs beyond model/optimizer weights for a bit-exact resume."""
    return {
        "step": trainer.step_count,
        "trainer": trainer.trainer_state(),
        "schedulers": {k: s.state_dict() for k, s in trainer.schedulers().items()},
        "generators": {"sample": trainer.generator.get_state(), "shuffle": trainer.shuffle_generator.get_state()},
        "rng": capture_rng_state(),
        "history": trainer.history,
        "config_yaml": config_to_yaml(trainer.config),
    }


def restore_extra(trainer: Trainer, extra: Mapping[str, Any]) -> None:
    """Put back what `extra_state` saved."""
    trainer.step_count = int(extra["step"])
    trainer.load_trainer_state(extra["trainer"])
    for name, sched in trainer.schedulers().items():
        if name not in extra["schedulers"]:
            raise CheckpointError(
                f"rank {trainer.rank}: the checkpoint holds no {name!r} for this rank (it has "
                f"{sorted(extra['schedulers'])}); it was saved with another role placement (devices.actor/"
                "critic/ref). Fix: resume with the devices.* placement it was saved with, or set "
                "trainer.resume=never")
        sched.load_state_dict(extra["schedulers"][name])
    trainer.generator.set_state(extra["generators"]["sample"])
    trainer.shuffle_generator.set_state(extra["generators"]["shuffle"])
    restore_rng_state(extra["rng"])
    trainer.history = list(extra.get("history", []))


def log_metrics(trainer: Trainer, tracker: Any, metrics: dict[str, float], step: int, *, always: bool = False) -> None:
    """Keep every metric row in the history; send every `log_every`-th (and the first and last, or `always`) on."""
    if not metrics:
        return
    trainer.history.append({"step": step, **metrics})
    total = trainer.config.trainer.total_steps
    if always or step % trainer.config.trainer.log_every == 0 or step == total or step == 0:
        tracker.log(metrics, step)


def log_validation_samples(trainer: Trainer, tracker: Any, step: int) -> None:
    """The generations of the validation that just ran (`trainer.validation_samples`, RL only)."""
    samples = trainer.validation_samples
    if samples:
        tracker.log_samples(samples[: trainer.config.trainer.log_samples], step)
    trainer.validation_samples = None


def log_traces(trainer: Trainer, tracker: Any, step: int) -> None:
    """The step's traced rollouts and token values (`trainer.trace.rows`, RL only) into their files."""
    trace = getattr(trainer, "trace", None)
    if trace is None or not trace.rows:
        return
    for name, rows in trace.rows.items():
        tracker.log_rows(name, rows, f"step {step}'s traced rollouts")
    trace.rows = {}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out |= _flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: tree}


def config_changes(saved_yaml: str | None, config: Any) -> list[str]:
    """`key: old -> new` for every config key that differs from the one a checkpoint was saved with."""
    if not saved_yaml:
        return []
    old, new = _flatten(yaml.safe_load(saved_yaml)), _flatten(config.model_dump(mode="json"))
    missing = "<unset>"
    return [f"{k}: {json.dumps(old.get(k, missing))} -> {json.dumps(new.get(k, missing))}"
            for k in sorted(old.keys() | new.keys()) if old.get(k, missing) != new.get(k, missing)]


def _rows(trainer: Trainer) -> str:
    counts = trainer.row_counts()
    return "" if counts is None else f"{counts[0]:,} train rows, {counts[1]:,} validation rows"


def banner_lines(trainer: Trainer, resume_from: Path | None, saved_yaml: str | None) -> list[str]:
    """What this run is: trainer, model and size, data, run directory, and what it resumes from (with the
    config keys that changed since that checkpoint). Short lines, so a terminal shows them whole."""
    cfg = trainer.config
    what = f"verl train: {cfg.trainer.kind}"
    if cfg.trainer.kind == "rl":
        what += f" ({cfg.algorithm.adv_estimator})"
    lines = [f"{what}, " + ("validation only" if cfg.trainer.val_only else f"{cfg.trainer.total_steps} steps")]
    model = trainer.model
    about = ""
    if model is not None:
        params = list(model.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        kind = getattr(getattr(model, "config", None), "model_type", None)
        size = f"{total:,} parameters" + (f", {trainable:,} trainable" if trainable != total else "")
        about = f" ({kind}, {size})" if kind else f" ({size})"
    lines.append(f"model: {cfg.model.path}{about}")
    rows = _rows(trainer)
    if rows:
        lines.append(f"data: {rows}")
    lines.append(f"run directory: {trainer.run_dir}")
    if trainer.device.type == "cpu":  # the kernel rounds differently: a result is reproduced on the same one
        lines.append(describe(cfg.trainer.cpu_matmul) if model is None else describe_cpu_matmul(cfg, model))
    sandbox = check_sandbox(cfg)[1]  # the isolation model-written code gets on this host
    lines += [sandbox] if sandbox else []
    if resume_from is None:
        why = "trainer.resume=never" if cfg.trainer.resume == "never" else "no checkpoint to resume"
        lines.append(f"{'validating the model as loaded' if cfg.trainer.val_only else 'starting from scratch'} ({why})")
    else:
        verb = "validating" if cfg.trainer.val_only else "resuming from"
        lines.append(f"{verb} {resume_from} (step {trainer.step_count}/{cfg.trainer.total_steps})")
        changes = config_changes(saved_yaml, cfg)
        lines.append("config changed since that checkpoint:" + ("" if changes else " nothing"))
        lines += [f"  {change}" for change in changes]
    return lines


class WeightWatch:
    """Whether any optimizer stepped since `changed` was last cleared: a process-wide optimizer step pre-hook
    while the loop runs (every trainer's update goes through `torch.optim.Optimizer.step`)."""

    def __init__(self) -> None:
        self.changed = False
        self._handle: Any = None

    def _hook(self, *args: Any) -> None:
        self.changed = True

    def __enter__(self) -> WeightWatch:
        self._handle = register_optimizer_step_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def _snapshot(extra: dict[str, Any]) -> dict[str, Any]:
    """A copy of `extra_state` that the next step cannot change, less the history (only logging adds to it:
    a save after an error takes it as it is then)."""
    return {k: copy.deepcopy(v) for k, v in extra.items() if k != "history"}


def _add_to_message(exc: BaseException, line: str) -> None:
    """`line` after the error's message (a VerlError prints as one line), or as a note under a traceback."""
    if isinstance(exc, VerlError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0].rstrip().rstrip('.')}. {line[0].upper()}{line[1:]}",)
    else:
        exc.add_note(line)


def _resume_line(saved: Path | None) -> str:
    if saved is None:
        return "no checkpoint was saved, so a rerun starts from scratch"
    return f"a resume starts from {saved.name} ({saved}): rerun the same command (trainer.resume=auto)"


def fit(trainer: Trainer) -> list[dict[str, float]]:
    """Train for `trainer.total_steps` (resuming first when a checkpoint exists); returns the history.

    A SIGINT/SIGTERM saves a checkpoint at the end of the current step and raises `TrainingInterrupted`. An
    error raised by a step before any optimizer stepped in it, or by the validation or logging after it,
    saves the last completed step (in one process: with several, the other ranks may be elsewhere) and is
    re-raised saying so; otherwise its message names the checkpoint a resume starts from.
    """
    cfg = trainer.config
    if cfg.trainer.val_only and (trainer.row_counts() or (0, 0))[1] == 0:  # e.g. rows passed in from Python
        raise ConfigError(VAL_ONLY_NEEDS_ROWS)
    started = time.monotonic()
    ckpt = setup_checkpoints(cfg, trainer.run_dir, trainer.parts.process)
    resume_from = ckpt.find_resume(cfg.trainer.resume)
    saved_yaml = None
    keep_best = KeepBest.from_config(cfg)  # checkpoint.keep_best: the best validation's checkpoint is kept
    stop_rule = StopRule.from_config(cfg)  # trainer.stop_when: a validation that ends training
    ended = False  # this run's checkpoint is one trainer.stop_when ended (then a rerun trains no further)
    if resume_from is not None:
        extra = ckpt.load(resume_from, app_state=trainer.app_state())
        saved_yaml = extra.get("config_yaml")
        ended = stop_rule is not None and extra.get(STOPPED_KEY) == stop_rule.rule
        trainer._restore_extra(extra)
        if keep_best is not None:
            keep_best.load_state_dict(extra.get("keep_best"), ckpt.root)
    if not cfg.trainer.val_only:  # best.json names this run's best as of where it starts (or nothing)
        ckpt.set_best(keep_best.record if keep_best is not None else None)
    if trainer.rank == 0:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        (trainer.run_dir / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
    tracker = setup_tracker(cfg, trainer.run_dir, trainer.parts.process, resume_step=trainer.step_count,
                            fresh=resume_from is None)
    if keep_best is not None and tracker.console is not None:  # shown on every step line that has it
        tracker.console.first_keys = (keep_best.metric,)
    if resume_from is not None and trainer.rank == 0 and not cfg.trainer.val_only:  # val_only deletes nothing
        tracker.truncate_after(trainer.step_count)
    for line in banner_lines(trainer, resume_from, saved_yaml) if trainer.rank == 0 else []:
        tracker.print(line)
    for old, new in tracker.rotated:
        tracker.print(f"a fresh run in an existing run directory: moved the old {old.name} to {new.name}")
    saved = None
    newest = resume_from  # the checkpoint a resume would start from, for the message of an error that ends the run
    stop = GracefulStop()
    weights = WeightWatch()
    one_process = trainer.world_size == 1
    phase = "start"  # "step": in trainer.step(); "after": its validation and logs; "save": writing a checkpoint
    done: tuple[int, dict[str, Any]] | None = None  # (step, its extra state) of the last completed step, unsaved
    try:
        with stop, weights:
            if cfg.trainer.val_only:
                log_metrics(trainer, tracker, trainer.validate(), trainer.step_count, always=True)
                log_validation_samples(trainer, tracker, trainer.step_count)
                return trainer.history
            tracker.start_progress(trainer.step_count)
            if trainer.step_count == 0 and cfg.trainer.val_before_train:
                metrics = trainer.validate()
                if keep_best is not None:  # the model as loaded is no checkpoint: only the name is checked
                    keep_best.check(metrics)
                if stop_rule is not None:  # nor does it end a run that has not trained
                    stop_rule.check(metrics)
                trainer._log(tracker, metrics, 0)
                log_validation_samples(trainer, tracker, 0)
            if ended:
                tracker.print(f"step {trainer.step_count}: trainer.stop_when={stop_rule.rule} ended this run there; "
                              "nothing to train (a different trainer.stop_when, or none, trains on)")
            while trainer.step_count < cfg.trainer.total_steps and not ended:
                heartbeat.note(step=trainer.step_count + 1)  # what the other ranks name if this one falls silent
                weights.changed, phase = False, "step"
                metrics = trainer.step()
                trainer.step_count += 1
                phase = "after"
                if one_process:  # what a save of this step would hold if its validation or logging raises
                    done = (trainer.step_count, _snapshot(trainer._extra_state() | (
                        {} if keep_best is None else {"keep_best": keep_best.state_dict()})))
                last = trainer.step_count == cfg.trainer.total_steps
                every = cfg.trainer.val_every
                validated = last or bool(every and trainer.step_count % every == 0)
                if validated:
                    metrics |= trainer.validate()
                best = keep_best.offer(trainer.step_count, metrics) if validated and keep_best is not None else None
                ended = validated and stop_rule is not None and stop_rule.reached(metrics)
                tracker.progress(trainer.step_count)
                trainer._log(tracker, metrics, trainer.step_count)
                log_traces(trainer, tracker, trainer.step_count)
                signal_watch.watch(trainer, metrics, trainer.step_count)  # warns once after steps without signal
                if validated:
                    log_validation_samples(trainer, tracker, trainer.step_count)
                stopping = stop.agree(trainer.parts.process.device)  # every rank, or none, stops here
                if ckpt.should_save(trainer.step_count, last or ended) or stopping or best is not None:
                    phase = "save"
                    extra = trainer._extra_state() | ({} if keep_best is None
                                                      else {"keep_best": keep_best.state_dict()})
                    if ended:
                        extra[STOPPED_KEY] = stop_rule.rule
                    ckpt.save(trainer.step_count, app_state=trainer.app_state(), extra=extra,
                              hf_assets=trainer.hf_assets(), best=best)
                    saved = newest = ckpt.root / f"step_{trainer.step_count}"
                    done = None
                phase = "between"
                if best is not None and trainer.rank == 0:
                    tracker.print(f"step {best.step}: best {best.describe()} so far; keeping {saved}")
                if ended and trainer.rank == 0:
                    tracker.print(f"step {trainer.step_count}: {stop_rule.metric}={metrics[stop_rule.metric]:.4g} "
                                  f"reached trainer.stop_when={stop_rule.rule}: training ends here ({saved})")
                if stopping or ended:
                    break
        phase = "end"
        ckpt.wait()
        if trainer.rank == 0:
            for line in run_summary_lines(trainer, keep_best, newest, time.monotonic() - started):
                tracker.print(line)
    except Exception as exc:
        if phase in ("step", "after", "between"):
            newest = _save_after_error(trainer, ckpt, exc, phase, weights.changed, done, newest)
        raise
    finally:
        ckpt.close()
        tracker.close()
    if stop.received is not None and trainer.step_count < cfg.trainer.total_steps:
        raise TrainingInterrupted(stop.received, trainer.step_count, cfg.trainer.total_steps,
                                  str(saved) if saved is not None else None)
    return trainer.history


def _save_after_error(trainer: Trainer, ckpt: Any, exc: BaseException, phase: str, weights_changed: bool,
                      done: tuple[int, dict[str, Any]] | None, newest: Path | None) -> Path | None:
    """Save the last completed step after `exc` ended the run when the state is intact, and add to the
    error's message what was saved, or which checkpoint a resume starts from. Returns the newest checkpoint."""
    failed = trainer.step_count + 1 if phase == "step" else trainer.step_count
    total = trainer.config.trainer.total_steps
    if phase == "step" and weights_changed:
        _add_to_message(exc, f"step {failed}/{total} failed after its update had changed the weights, so it was "
                        f"not saved; {_resume_line(newest)}")
        return newest
    if done is None:  # saved already (or nothing completed, or several processes: no collective save here)
        why = "" if trainer.world_size == 1 else f" (not saved here: {trainer.world_size} processes)"
        _add_to_message(exc, f"step {failed}/{total} failed{why}; {_resume_line(newest)}")
        return newest
    step, extra = done
    try:
        ckpt.wait()  # a save still in flight goes first
        extra = extra | {"history": [row for row in trainer.history if row.get("step", 0) <= step]}
        ckpt.save(step, app_state=trainer.app_state(), extra=extra, hf_assets=trainer.hf_assets())
        ckpt.wait()
    except Exception as save_exc:  # the original error is the one to report
        _add_to_message(exc, f"step {failed}/{total} failed; saving step {step} then failed too ({save_exc}); "
                        f"{_resume_line(newest)}")
        return newest
    path = ckpt.root / f"step_{step}"
    when = "before its update" if phase == "step" else "after its update"
    _add_to_message(exc, f"step {failed}/{total} failed {when}; saved step {step}; resume with the same command "
                    f"(trainer.resume=auto) to start from {path}")
    return path


__all__ = ["WeightWatch", "banner_lines", "config_changes", "extra_state", "fit", "log_metrics",
           "log_validation_samples", "restore_extra"]
