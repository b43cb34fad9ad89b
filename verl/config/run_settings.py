"""The sections of how a run is carried out: device placement, checkpoints, the trainer loop, logging."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from verl.config.section import MAX_SEED, MAX_THREADS, Section, _home, _split_csv
from verl.utils.cpu_matmul import CpuMatmul

_STOP_RULE = re.compile(r"^\s*(?P<metric>[^\s<>=]+)\s*(?P<op>>=|<=)\s*"
                        r"(?P<value>[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)\s*$")


def parse_stop_rule(rule: str) -> tuple[str, str, float]:
    """`trainer.stop_when` as (metric, ">=" or "<=", value)."""
    m = _STOP_RULE.match(rule)
    if m is None:
        raise ValueError(f"trainer.stop_when={rule!r} is not METRIC>=VALUE or METRIC<=VALUE (e.g. "
                         "'val/accuracy>=0.97' or 'val/loss<=0.2')")
    return m["metric"], m["op"], float(m["value"])


class DevicesConfig(Section):
    actor: list[int] | None = Field(None, description="Global ranks; None = every rank.")
    critic: list[int] | None = None
    ref: list[int] | None = None
    reward: list[int] | None = None
    teacher: list[int] | None = Field(None, description="Global ranks of the distillation teacher; None = every rank.")
    rollout: list[int] | None = Field(None, description="Ranks that only generate (asynchronous RL, "
                                      "rollout.max_staleness), apart from every training role; None = the actor "
                                      "generates between its updates.")
    num_gpus_per_node: int | None = Field(None, gt=0)
    allow_mixed_dtype: bool = False
    timeout_s: float = Field(600.0, gt=0.0)
    heartbeat_s: float = Field(60.0, ge=0.0, description="Seconds without a heartbeat after which every other rank "
                               "warns, once, that a rank stopped answering (stopped, or hung holding the GIL), naming "
                               "its last collective stage and step; a collective that needs it still fails at "
                               "timeout_s. 0 = off (e.g. while a debugger holds a rank).")

    _split = field_validator("actor", "critic", "ref", "reward", "teacher", "rollout", mode="before")(_split_csv)


class CheckpointConfig(Section):
    save_interval: int = Field(0, ge=0, description="Steps between saves; 0 = only at the end.")
    save_total_limit: int | None = Field(None, gt=0)
    async_save: bool = False
    keep_best: str | None = Field(None, description="A validation metric (val/pass@1, val/score, val/<source>/maj@4, "
                                  "...): the checkpoint of the best value so far is kept apart from the "
                                  "save_total_limit rotation, marked in `verl ckpt list` and checkpoints/best.json. "
                                  "A validation that improves it saves that step's checkpoint even off "
                                  "save_interval; the validation before training does not count. None = off.")
    keep_best_mode: Literal["max", "min"] = Field("max", description="Whether keep_best's best is its largest "
                                                  "(accuracy, pass@k) or smallest (a loss) value.")


class TrainerConfig(Section):
    kind: Literal["rl", "dpo", "sft", "rm"] = "rl"
    total_steps: int = Field(100, gt=0)
    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seeds every generator of the run (0 to 2^63-1, the range "
                      "torch and numpy take).")
    run_dir: str | None = Field(None, description="None = runs/<kind>-<timestamp>.")
    resume: str = Field("auto", description="auto | never | PATH to a checkpoint.")

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_range(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 <= v <= MAX_SEED:
            raise ValueError(f"a seed is a whole number from 0 to 2^63-1 ({MAX_SEED}), the range torch and numpy "
                             f"take; {v!r} is outside it")
        return v

    _home = field_validator("run_dir", "resume", mode="before")(_home)
    val_every: int = Field(0, ge=0, description="Validate every N steps; 0 = only at the end.")
    val_before_train: bool = True
    stop_when: str | None = Field(None, description="End training early at the first validation (after a step) "
                                  "whose metric reaches a value: `METRIC>=VALUE` or `METRIC<=VALUE`, e.g. "
                                  "`val/accuracy>=0.97` (a warm start or a reward model trained until it is good "
                                  "enough); that step is saved as the last checkpoint. None = train total_steps.")

    @field_validator("stop_when")
    @classmethod
    def _stop_rule(cls, v: str | None) -> str | None:
        if v is not None:
            parse_stop_rule(v)  # raises ValueError naming the expected form
        return v

    val_only: bool = Field(False, description="Validate once, on the checkpoint `trainer.resume` finds (or the "
                           "model as loaded), and stop: no training step, no checkpoint (volcengine/verl's key).")
    device: str = Field("auto", description="auto | cpu | cuda")
    log_every: int = Field(1, gt=0, description="Log (console line, JSONL row, backends) every N steps.")
    log_samples: int = Field(8, ge=0, description="Validation generations written to samples.jsonl (and "
                             "TensorBoard/wandb/MLflow) per validation; 0 = none.")
    cpu_threads: int | None = Field(None, gt=0, le=MAX_THREADS, description="torch CPU threads; 1 is fastest for "
                                    f"tiny models (at most {MAX_THREADS}).")
    cpu_matmul: CpuMatmul = Field(
        "auto", description="Library for float32 linear layers on CPU: auto = oneDNN where it is clearly faster on "
        "this host (at least 1.3x on the run's own layer shapes, each product's fastest of interleaved repeats, "
        "measured once and kept in "
        "$VERL_CACHE_DIR/cpu_matmul; AMD processors where MKL takes a generic path), else ATen; the environment "
        "variable VERL_CPU_MATMUL=aten|onednn decides auto instead; aten | onednn force one. Under auto a "
        "rollout's decode steps measure their own projections (weights streamed from memory) and choose apart "
        "(verl.utils.cpu_matmul; benchmarks/cpu_matmul.py times both).")
    demo: Literal["arithmetic", "tool", "agent", "rlhf", "vision"] | None = Field(
        None, description="`verl train` runs this config as a demo: a supervised warm start, then RL, held-out "
        "accuracy before and after, summary.json. arithmetic = the built-in demo (env arithmetic), tool = the "
        "calculator tool demo (env calculator), agent = OpenAI-client agent code calling a calculator through "
        "the trainer's endpoint (env calculator + env.agent), rlhf = SFT, then a reward model on preferences "
        "(trainer.kind: rm), then RL on that reward model alone (env arithmetic), vision = a tiny vision-language "
        "model counts coloured squares in pictures (env shapes, examples/vision_shapes.yaml).")


class LoggingConfig(Section):
    backends: list[str] = Field(default_factory=lambda: ["console", "jsonl"])
    project: str = "verl"
    experiment: str | None = None
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI; None = a file store in "
                                            "<run_dir>/mlruns.")
    rollout_samples: int = Field(4, ge=0, description="Training rollouts per RL step written to rollouts.jsonl "
                                 "(spread over the batch's prompts): prompt, response, reward and each reward "
                                 "function's part, advantage, an episode's transcript; read by `verl view`. 0 = none.")
    token_samples: int = Field(2, ge=0, description="Of those, responses per step whose per-token values go to "
                               "tokens.jsonl: the sampler's, the old policy's and the reference's log-probs, the "
                               "advantage, and as the update's loss saw them the log-prob, entropy, ratio, "
                               "rollout-correction weight and clipped tokens (no extra forward). 0 = none.")

    _split = field_validator("backends", mode="before")(_split_csv)
