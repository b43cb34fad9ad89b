"""The built-in demo: a tiny local model learns arithmetic, first supervised, then with GRPO.

It shows the whole product on a laptop CPU in a few minutes: the tiny model is built locally (no hub),
a short supervised warm start teaches the answer format, and RL then raises held-out accuracy. The
before/after numbers come from the same greedy validation, so the gain is the RL's.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from verl.config import load_config
from verl.config.schema import RunConfig
from verl.demos.warm_start import first_actor_rank, on_actor_ranks
from verl.errors import ConfigError
from verl.tracking.console import ConsoleReporter, format_points
from verl.trainer.offline.sft_trainer import SFTTrainer
from verl.trainer.rl_trainer import RLTrainer

# The warm start stops once the model answers this share of its *training* problems (greedy).
SFT_TARGET_ACCURACY = 0.4
# Training problems the warm start probes and does not train on (at most a quarter of them).
PROBE_SIZE = 128


def demo_config_path() -> str:
    return str(resources.files("verl.config") / "presets" / "demo.yaml")


def warm_start_until(trainer: RLTrainer, target: float, max_steps: int, chunk: int = 10,
                     progress: ConsoleReporter | None = None) -> tuple[int, float, list]:
    """SFT (with `SFTTrainer`) in chunks until greedy accuracy on `PROBE_SIZE` *training* problems that the
    warm start does not train on reaches `target`, or `max_steps`. Probing training problems keeps the
    held-out set untouched; probing ones it does not learn by heart measures the skill, so RL starts from
    a similar competence for every seed (probed on the problems it trained on, a seed could stop far lower
    held-out and end below the demo's bar). Accuracy climbs steeply once the format is learnt, so it is
    checked every `chunk` (10) steps: checked more rarely, it can overshoot and leave RL little to gain."""
    if not callable(getattr(trainer.env, "sft_pairs", None)):
        raise ConfigError(f"trainer.demo=arithmetic warm-starts on the environment's sft_pairs(), which "
                          f"{type(trainer.env).__name__} does not have; use env.name: arithmetic, or remove "
                          "trainer.demo to train this config normally.")
    pairs = trainer.env.sft_pairs()
    probe_size = min(PROBE_SIZE, len(pairs) // 4)  # a small user env keeps most of its problems to learn from
    held_in, taught = pairs[:probe_size], pairs[probe_size:]
    if not held_in:
        raise ConfigError(f"the arithmetic warm start needs at least 4 training problems to probe on one it "
                          f"does not train on; {type(trainer.env).__name__} has {len(pairs)}: raise "
                          "env.kwargs.max_operand (or lower num_val).")
    sft = constant_lr_sft(trainer, train_rows=[{"input": prompt, "output": answer} for prompt, answer in taught])
    probe = [{"prompt": p, "ground_truth": a, "data_source": "arithmetic", "metadata": {}} for p, a in held_in]
    return sft_until(sft, lambda: trainer.evaluate(probe, prefix="train").get("train/accuracy", 0.0), target,
                     max_steps, chunk, progress)


def constant_lr_sft(trainer: RLTrainer, **data: Any) -> SFTTrainer:
    """An `SFTTrainer` on the RL trainer's model and ranks (its parts: on a split placement, the actor's ranks,
    data-parallel over them) at a constant `sft.lr`: a warm start that stops on accuracy, not on a budget, so
    the RL's warm-up and decay (actor.*) would only make where it stops depend on them."""
    actor = trainer.config.actor.model_copy(update={"lr_schedule": "constant", "warmup_steps": 0})
    config = trainer.config.model_copy(update={"actor": actor})
    return SFTTrainer(config, parts=trainer.parts, **data)


def sft_until(sft: SFTTrainer, accuracy: Callable[[], float], target: float, max_steps: int, chunk: int = 10,
              progress: ConsoleReporter | None = None, near: tuple[float, int] | None = None,
              ceiling: float | None = None, retries: int = 4) -> tuple[int, float, list]:
    """`sft.train_steps` in chunks of `chunk` until `accuracy()` reaches `target` or `max_steps` are taken:
    (steps, last accuracy, per-step history of the steps kept). `near=(accuracy, steps)`: once `accuracy()` has
    reached that accuracy, check every that many steps instead (a skill learnt abruptly is caught close to the
    target, and the checks of the flat start cost less). `ceiling`: a check above it (the skill came between
    two checks and overshot: what RL can gain then depends on the draw) goes back to the weights and optimizer
    state of the check before and takes the steps again on the next batches, at most `retries` times; the
    steps taken again count against `max_steps`."""
    steps, acc, history, taken, retried = 0, 0.0, [], 0, 0
    saved = _sft_state(sft) if ceiling is not None else None
    while taken < max_steps and acc < target:
        every = near[1] if near is not None and acc >= near[0] else chunk
        new = sft.train_steps(min(every, max_steps - taken))
        taken += len(new)
        checked = accuracy()
        if ceiling is not None and checked > ceiling and retried < retries and taken < max_steps:
            retried += 1
            _load_sft_state(sft, saved)  # acc, steps and history stay those of the check before
            continue
        history += new
        steps, acc = len(history), checked
        if saved is not None:
            saved = _sft_state(sft)
        if progress is not None:
            progress.advance(steps)
            progress.log(steps, {"loss": history[-1]["loss"], "train/accuracy": acc})
    return steps, acc, history


def _sft_state(sft: SFTTrainer) -> tuple[dict, dict]:
    """A copy of the SFT's weights and optimizer state (a warm start's model: small enough to copy)."""
    return copy.deepcopy(sft.model.state_dict()), copy.deepcopy(sft.optimizer.state_dict())


def _load_sft_state(sft: SFTTrainer, state: tuple[dict, dict]) -> None:
    model, optimizer = state
    sft.model.load_state_dict(model)
    sft.optimizer.load_state_dict(optimizer)


def model_line(model: Any) -> str:
    """" MODEL_TYPE model (N parameters)" for a demo's banner; " model" on a rank that holds no policy."""
    if model is None:
        return " model"
    return f" {model.config.model_type} model ({sum(p.numel() for p in model.parameters()):,} parameters)"


def run_summary(trainer: Any, start: float, sft_seconds: float, rl_seconds: float, before: float, after: float,
                **results: Any) -> dict[str, Any]:
    """A demo's summary.json: held-out accuracy `before` and `after` RL and their gain, its `results`, then what
    every demo records (RL steps, seed, wall, warm-start and RL seconds, run directory)."""
    return {"accuracy_after_sft": before, "accuracy_after_rl": after, "accuracy_gain": after - before,
            **results, "steps": trainer.step_count, "seed": trainer.config.trainer.seed,
            "wall_seconds": time.perf_counter() - start, "sft_seconds": sft_seconds, "rl_seconds": rl_seconds,
            "run_dir": str(trainer.run_dir)}


def recipe_main(argv: list[str] | None, module: str, example: str, run: Callable[[RunConfig], Any]) -> int:
    """`python -m verl.demos.MODULE CONFIG [key=value ...]`: `run` on that config (one torch thread, as the
    demos' rows were measured); exit code 2 with the usage line when no config is named."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or "=" in args[0]:
        print(f"usage: python -m verl.demos.{module} {example} [key=value ...]", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    run(load_config(args[0], overrides=args[1:]))
    return 0


def run_demo(config: RunConfig) -> dict[str, Any]:
    """Warm start, GRPO, summary. Under torchrun the warm start runs on the actor's ranks (data-parallel over
    them) while any other ranks wait (`on_actor_ranks`): rollout ranks of their own (`devices.rollout`) then
    get the warmed weights by the first step's delivery and generate asynchronously."""
    start = time.perf_counter()
    trainer = RLTrainer(config)
    console = Console(quiet=trainer.rank != 0)  # under torchrun, one summary
    model = trainer.model  # None on a rank holding only a reference or critic
    console.print(f"[bold]verl demo[/]: tiny{model_line(model)} on {len(trainer.env)} arithmetic problems, "
                  f"{len(trainer.env.val_rows())} held out")
    t0 = time.perf_counter()
    max_sft = config.sft.steps or 1500
    warm = ConsoleReporter(max_sft, label="warm start: SFT step", enabled=trainer.rank == first_actor_rank(trainer))
    warm.print(f"warm start: SFT until greedy accuracy on training problems reaches {SFT_TARGET_ACCURACY:.0%} "
               f"(at most {max_sft} steps)")

    def warm_start() -> dict[str, float]:
        warm.start(0)
        try:
            steps, accuracy, sft = warm_start_until(trainer, SFT_TARGET_ACCURACY, max_sft, progress=warm)
        finally:
            warm.stop()
        return {"steps": steps, "accuracy": accuracy, "first_loss": sft[0]["loss"], "last_loss": sft[-1]["loss"]}

    warmed = on_actor_ranks(trainer, warm_start)
    sft_steps, train_acc = int(warmed["steps"]), warmed["accuracy"]
    sft_seconds = time.perf_counter() - t0
    console.print(f"warm start: {sft_steps} SFT steps, loss {warmed['first_loss']:.3f} -> {warmed['last_loss']:.3f}, "
                  f"greedy accuracy on training problems {train_acc:.0%} ({sft_seconds:.1f}s); now GRPO")
    t0 = time.perf_counter()
    history = trainer.fit()
    rl_seconds = time.perf_counter() - t0
    val = [h for h in history if "val/accuracy" in h]
    before, after = val[0]["val/accuracy"], val[-1]["val/accuracy"]
    steps = [h for h in history if h["step"] > 0 and "timing/step" in h]
    stages = sorted({k for h in steps for k in h if k.startswith("timing/") and k != "timing/step"})
    summary = run_summary(
        trainer, start, sft_seconds, rl_seconds, before, after, sft_steps=sft_steps,
        seconds_per_stage={k.split("/", 1)[1]: sum(h.get(k, 0.0) for h in steps) for k in stages})
    path = trainer.write_summary(summary)
    table = Table(title="verl demo summary")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("held-out accuracy after SFT", f"{before:.1%}")
    table.add_row("held-out accuracy after GRPO", f"{after:.1%}")
    table.add_row("gain", format_points(after - before))
    table.add_row("RL steps", str(trainer.step_count))
    table.add_row("wall time", f"{summary['wall_seconds']:.0f}s")
    for stage, seconds in summary["seconds_per_stage"].items():
        table.add_row(f"  time in {stage}", f"{seconds:.1f}s")
    console.print(table)
    console.print(f"run directory: {trainer.run_dir}  (summary: {path})", markup=False)
    return summary
