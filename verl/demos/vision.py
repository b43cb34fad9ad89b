"""The vision demo: a tiny Qwen2.5-VL-style model learns to count coloured squares in pictures, SFT then GRPO.

`verl train examples/vision_shapes.yaml [key=value ...]` (the config's `trainer.demo: vision`), or
`python -m verl.demos.vision examples/vision_shapes.yaml [key=value ...]`.

The environment (`verl.env.shapes`) draws 56x56 pictures of a 2x2 board (one image token per cell) and asks
"How many red squares?" (or green, blue); the count is uniform in 0..3, so a model that ignores the picture
answers a quarter right. The tiny model, vision tower included, is built locally. A supervised warm start on
the training problems (the pictures through the processor, their tokens never in the loss) stops once greedy
answers on training problems it does not train on reach `SFT_TARGET_ACCURACY`; GRPO then trains on the same
pictures with the reward of an exact answer. Held-out accuracy (scenes that no training problem shows) comes
from the same greedy validation before and after RL, so the gain is the RL's; `summary.json` in the run
directory holds it.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from verl.config.schema import RunConfig
from verl.demos.arithmetic import constant_lr_sft, model_line, recipe_main, run_summary, sft_until
from verl.demos.warm_start import first_actor_rank, on_actor_ranks
from verl.errors import ConfigError
from verl.models.vision import is_vision_language
from verl.tracking.console import ConsoleReporter, format_points
from verl.trainer.rl_trainer import RLTrainer

# The warm start stops once greedy answers on PROBE_SIZE training problems it does not train on reach this share.
SFT_TARGET_ACCURACY = 0.4
# Training problems the warm start probes and does not train on.
PROBE_SIZE = 128
# Counting is learnt gradually once it starts, so a check every 10 steps stops close to the target.
SFT_CHECK_EVERY = 10


def warm_start(trainer: RLTrainer, target: float, max_steps: int,
               progress: ConsoleReporter | None = None) -> dict[str, float]:
    """SFT on the environment's `sft_rows()` (pictures included) until greedy accuracy on `PROBE_SIZE` other
    training problems reaches `target`, or `max_steps`: the held-out scenes stay untouched."""
    env = trainer.env
    if not callable(getattr(env, "sft_rows", None)):
        raise ConfigError(f"trainer.demo=vision warm-starts on the environment's sft_rows(), which "
                          f"{type(env).__name__} does not have; use env.name: shapes, or remove trainer.demo to "
                          "train this config normally.")
    rows = env.sft_rows()
    probe_size = min(PROBE_SIZE, len(rows) // 4)
    if not probe_size:
        raise ConfigError(f"the vision warm start needs at least 4 training problems to probe on one it does not "
                          f"train on; the environment has {len(rows)}: raise env.kwargs.num_train.")
    held_in, taught = rows[:probe_size], rows[probe_size:]
    probe = [{"prompt": r["input"], "images": r["images"], "ground_truth": r["output"], "data_source": "shapes",
              "metadata": {}} for r in held_in]
    sft = constant_lr_sft(trainer, train_rows=taught)
    steps, accuracy, history = sft_until(
        sft, lambda: trainer.evaluate(probe, prefix="train").get("train/accuracy", 0.0), target, max_steps,
        SFT_CHECK_EVERY, progress)
    return {"steps": steps, "accuracy": accuracy, "first_loss": history[0]["loss"] if history else 0.0,
            "last_loss": history[-1]["loss"] if history else 0.0}


def run_vision_demo(config: RunConfig) -> dict[str, Any]:
    """Warm start, GRPO, summary (the arithmetic demo's recipe on pictures)."""
    start = time.perf_counter()
    trainer = RLTrainer(config)
    console = Console(quiet=trainer.rank != 0)
    model = trainer.model
    if model is not None and not is_vision_language(model):
        raise ConfigError(f"trainer.demo=vision needs a vision-language policy, got {model.config.model_type}; "
                          "use model.path: tiny:qwen2_5_vl (examples/vision_shapes.yaml).")
    console.print(f"[bold]verl vision demo[/]: tiny{model_line(model)} counts coloured squares; "
                  f"{len(trainer.env)} training pictures, {len(trainer.env.val_rows())} held out")
    t0 = time.perf_counter()
    max_sft = config.sft.steps or 600
    progress = ConsoleReporter(max_sft, label="warm start: SFT step",
                               enabled=trainer.rank == first_actor_rank(trainer))
    progress.print(f"warm start: SFT until greedy accuracy on training problems reaches {SFT_TARGET_ACCURACY:.0%} "
                   f"(at most {max_sft} steps)")

    def work() -> dict[str, float]:
        progress.start(0)
        try:
            return warm_start(trainer, SFT_TARGET_ACCURACY, max_sft, progress)
        finally:
            progress.stop()

    warmed = on_actor_ranks(trainer, work)
    sft_seconds = time.perf_counter() - t0
    console.print(f"warm start: {int(warmed['steps'])} SFT steps, loss {warmed['first_loss']:.3f} -> "
                  f"{warmed['last_loss']:.3f}, greedy accuracy on training problems {warmed['accuracy']:.0%} "
                  f"({sft_seconds:.1f}s); now GRPO")
    t0 = time.perf_counter()
    history = trainer.fit()
    rl_seconds = time.perf_counter() - t0
    val = [h for h in history if "val/accuracy" in h]
    if not val:
        raise ConfigError("trainer.demo=vision compares held-out accuracy before and after RL; set "
                          "trainer.val_before_train: true and trainer.val_every to at most trainer.total_steps.")
    before, after = val[0]["val/accuracy"], val[-1]["val/accuracy"]
    summary = run_summary(trainer, start, sft_seconds, rl_seconds, before, after, sft_steps=int(warmed["steps"]),
                          sft_probe_accuracy=warmed["accuracy"])
    path = trainer.write_summary(summary)
    console.print(f"held-out accuracy after SFT {before:.1%}, after GRPO {after:.1%} ({format_points(after - before)}"
                  f"); {trainer.step_count} RL steps, wall time {summary['wall_seconds']:.0f}s")
    console.print(f"run directory: {trainer.run_dir}  (summary: {path})", markup=False)
    return summary


def main(argv: list[str] | None = None) -> int:
    return recipe_main(argv, "vision", "examples/vision_shapes.yaml", run_vision_demo)


if __name__ == "__main__":
    raise SystemExit(main())
