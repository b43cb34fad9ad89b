"""The sections of how responses are scored (reward functions, reward model) and where model-written code runs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from verl.config.section import MAX_THREADS, Section, _home


def _function_specs(value: Any) -> Any:
    """`[numeric_match, reward.py:fn]` (names alone, as typed on a command line) as `[{name: ...}, ...]`."""
    if isinstance(value, (str, dict)):
        value = [value]
    if isinstance(value, list):
        return [{"name": v} if isinstance(v, str) else v for v in value]
    return value


class RewardConfig(Section):
    functions: list[dict[str, Any]] = Field(default_factory=list)
    _specs = field_validator("functions", mode="before")(_function_specs)
    model_path: str | None = None
    _home = field_validator("model_path", mode="before")(_home)
    model_dtype: str | None = None
    model_weight: float = 1.0
    model_batch_size: int = Field(16, gt=0, description="Sequences per reward-model forward (reward.model_path); "
                                  "a small reward model scores a whole step's responses faster in one batch.")
    workers: int = Field(4, ge=1, le=MAX_THREADS, description=f"Reward calls running at once (at most {MAX_THREADS}: "
                         "each is a thread or a process of its own), on threads (a per-sample function is one "
                         "call per sample; a batched or TRL-style function, a reward model or `remote` one call per "
                         "batch): slow rewards (code execution, HTTP) overlap instead of running one after another.")
    timeout_s: float = Field(60.0, gt=0.0, description="A reward call running longer is given up: its sample(s) score "
                             "0, counted in reward/timeouts, with the reason in samples.jsonl. Never retried: only "
                             "`remote` retries (its kwargs.retries, on connection errors and 5xx), within this same "
                             "limit, so keep it above kwargs.timeout_s x (retries + 1) plus back-off.")
    val_functions: list[dict[str, Any]] = Field(
        default_factory=list, description="Reward functions validation scores with instead of the training reward "
        "(reward.functions and reward.model_path), e.g. [numeric_match] to measure true held-out accuracy while a "
        "learned reward model trains the policy. Empty = validation scores as training does. Single-turn only.")
    _val_specs = field_validator("val_functions", mode="before")(_function_specs)
    executor: Literal["thread", "process"] = Field(
        "thread", description="Where per-sample reward functions run: `thread` (any callable) or `process` (worker "
        "processes: no GIL shared with generation, so CPU-bound rewards such as answer parsing run beside it, and a "
        "call past timeout_s is killed, not abandoned; the functions must be named in reward.functions or be "
        "importable). Batched and TRL-style functions run on threads either way.")
    max_worker_crashes: int = Field(8, ge=0, description="reward.executor=process: a worker process that dies in the "
                                    "middle of a call (os._exit, a signal, the OOM killer) fails only its sample, "
                                    "which scores 0 with the reason in samples.jsonl, counted in "
                                    "reward/worker_crashes, and a new worker takes its place; more crashes than this "
                                    "in one step stop the run (a RewardError naming the last one).")
    max_rss_mb: int = Field(4096, ge=0, description="reward.executor=process: a worker process whose resident "
                            "memory exceeds this many MiB after a call (a reward that leaks) is replaced by a "
                            "new one, counted in reward/worker_replacements; the call's result still counts. "
                            "0 = no limit. Keep it well above a fresh worker's size (what the functions load).")
    overlap: bool = Field(True, description="Start each response's per-sample reward calls as soon as it finishes "
                          "generating, while the rest of the batch is still sampled (single-turn rollouts on verl's "
                          "own engine); the scores are the same as with false (score after generation).")


class SandboxConfig(Section):
    require: list[str] = Field(default_factory=list, description="Isolation that model-written code (the code_exec "
                               "reward, the python tool) must have: any of network, pid, tmp, user, filesystem, memory "
                               "(verl.sandbox.FEATURES). A host that cannot give one refuses to start, naming the fix.")
    python: str | None = Field(None, description="The interpreter model-written code runs in; None = this one, or "
                               "the system's python3 when this one is not readable by an unprivileged uid.")
