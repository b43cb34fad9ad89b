"""The training loop every trainer shares: resume, validate, step, log, checkpoint, stop on a signal.

It only calls the trainer's `step()`, `validate()` and its state hooks (`app_state()`, `trainer_state()`,
`load_trainer_state()`, `schedulers()`, `hf_assets()`), so RL, SFT and DPO resume the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl.checkpoint import CheckpointManager, GracefulStop, capture_rng_state, restore_rng_state
from verl.config.loader import config_to_yaml
from verl.errors import CheckpointError
from verl.tracking import Tracker


def extra_state(trainer: Any) -> dict[str, Any]:
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


def restore_extra(trainer: Any, extra: Mapping[str, Any]) -> None:
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


def log_metrics(trainer: Any, tracker: Any, metrics: dict[str, float], step: int) -> None:
    """Keep every metric row in the history; send every `log_every`-th (and the first and last) on."""
    if not metrics:
        return
    trainer.history.append({"step": step, **metrics})
    total = trainer.config.trainer.total_steps
    if step % trainer.config.trainer.log_every == 0 or step == total or step == 0:
        tracker.log(metrics, step)


def fit(trainer: Any) -> list[dict[str, float]]:
    """Train for `trainer.total_steps` (resuming first when a checkpoint exists); returns the history."""
    cfg = trainer.config
    ckpt = CheckpointManager(trainer.run_dir, save_interval=cfg.checkpoint.save_interval,
                             save_total_limit=cfg.checkpoint.save_total_limit,
                             async_save=cfg.checkpoint.async_save, rank=trainer.rank, world_size=trainer.world_size)
    resume_from = ckpt.find_resume(cfg.trainer.resume)
    if resume_from is not None:
        trainer._restore_extra(ckpt.load(resume_from, app_state=trainer.app_state()))
    if trainer.rank == 0:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        (trainer.run_dir / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
    tracker = Tracker(cfg.logging.backends, trainer.run_dir, config=cfg.model_dump(mode="json"),
                      total_steps=cfg.trainer.total_steps, project=cfg.logging.project,
                      experiment=cfg.logging.experiment, enabled=trainer.rank == 0, resume_step=trainer.step_count)
    if resume_from is not None and trainer.rank == 0:
        tracker.truncate_after(trainer.step_count)
    try:
        with GracefulStop() as stop:
            if trainer.step_count == 0 and cfg.trainer.val_before_train:
                trainer._log(tracker, trainer.validate(), 0)
            while trainer.step_count < cfg.trainer.total_steps:
                metrics = trainer.step()
                trainer.step_count += 1
                last = trainer.step_count == cfg.trainer.total_steps
                every = cfg.trainer.val_every
                if last or (every and trainer.step_count % every == 0):
                    metrics |= trainer.validate()
                trainer._log(tracker, metrics, trainer.step_count)
                if ckpt.should_save(trainer.step_count, last) or stop.requested:
                    ckpt.save(trainer.step_count, app_state=trainer.app_state(), extra=trainer._extra_state(),
                              hf_assets=trainer.hf_assets())
                if stop.requested:
                    break
        ckpt.wait()
    finally:
        ckpt.close()
        tracker.close()
    return trainer.history


__all__ = ["extra_state", "fit", "log_metrics", "restore_extra"]
