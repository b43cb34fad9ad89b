"""Start-up validation shared by every trainer and by `verl check`: one check, one place.

Everything here runs before any weights load: batch arithmetic, the role -> device mapping, the FSDP
option rules, the logging backends, a writable run folder and a memory estimate from parameter counts (read off the
model config on the meta device). A run that cannot work fails in seconds with every problem listed, not after the
model loaded.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.distributed.mapping import DeviceMapping, validate_device_mapping
from verl.distributed.memory import OPTIMIZER_STATES, TRAINABLE_ROLES, estimate_memory
from verl.distributed.memory_plan import plan_memory, suggestions
from verl.distributed.sequence_parallel import (
    describe_sequence_parallel,
    sequence_parallel_problems,
)
from verl.errors import ConfigError, VerlError
from verl.rollout.agent_episodes import agent_problems
from verl.rollout.async_rollout import describe as describe_async
from verl.rollout.engine_check import check_rollout_engine, check_vllm_placement, describe_vllm_memory
from verl.tracking.tracker import backend_problems
from verl.trainer.build.fsdp_launch import fsdp_launch
from verl.trainer.build.precision import check_master_precision, resolve_precision, role_dtype_names
from verl.trainer.checks.config_checks import (  # noqa: F401  (re-exported: the checks' old home)
    COLOCATED_DEMOS,
    DEMO_ENVS,
    VAL_ONLY_NEEDS_ROWS,
    check_demo_env,
    check_demo_placement,
    check_env_data,
    check_env_options,
    check_filter_groups_placement,
    check_keep_best,
    check_offline_options,
    check_old_logprobs,
    check_overlong_buffer,
    check_response_length,
    check_run_dir,
    check_sandbox,
    check_stop_when,
    check_val_n,
    runs_model_code,
    split_refusal,
)
from verl.trainer.checks.host_memory import check_host_memory, check_positions, text_config
from verl.trainer.checks.image_checks import check_images
from verl.trainer.checks.lora_checks import check_lora, memory_counts, uses_lora
from verl.trainer.checks.memory_inputs import model_shape, plan_inputs, targets_gpu
from verl.trainer.checks.policy_facts import (  # noqa: F401  (re-exported)
    PolicyFacts,
    count_parameters,
    read_model_facts,
    teacher_parameters,
)
from verl.trainer.checks.tensor_parallel_checks import describe_tensor_parallel, tensor_parallel_problems
from verl.trainer.forward.batch_math import plan_rl
from verl.trainer.forward.packing import describe_remove_padding
from verl.trainer.rl.correction import plan_correction, plan_old_logprobs
from verl.trainer.rl.distill import describe as describe_distillation
from verl.utils.dtype import bytes_per_element, check_dtype_for_device


@dataclass
class StartupReport:
    """What the weight-free checks worked out (plans, mapping, memory) and every problem they found."""

    world_size: int
    problems: list[VerlError] = field(default_factory=list)
    plans: dict[str, Any] = field(default_factory=dict)
    mapping: DeviceMapping | None = None
    fsdp_notes: list[str] = field(default_factory=list)
    rl_notes: list[str] = field(default_factory=list)  # what the RL step will do (e.g. the rollout correction)
    memory: Any = None
    memory_warnings: list[str] = field(default_factory=list)
    plan_inputs: Any = None  # memory_plan.PlanInputs of an RL/SFT/DPO run for GPUs (printed by `verl check`)
    parameters: Any = None  # lora_checks.ParameterCounts: trainable and total parameters (LoRA or not)


def plans_for(config: RunConfig, dp_size: int, critic_dp_size: int | None = None, *,
              kind: str | None = None) -> dict[str, Any]:
    """RL batch plans per role; for SFT/DPO, whether the step's batch splits evenly over the ranks."""
    kind = kind or config.trainer.kind
    if kind == "rl":
        return plan_rl(config, dp_size, critic_dp_size)
    key, size = ("sft.batch_size", config.sft.batch_size) if kind == "sft" else ("data.train_batch_size",
                                                                                config.data.train_batch_size)
    if size % dp_size:
        raise ConfigError(f"{key}={size} cannot be split evenly over {dp_size} data-parallel ranks; use a "
                          f"multiple of {dp_size}")
    return {}


def splitting_roles(config: RunConfig, mapping: DeviceMapping | None) -> dict[str, tuple[str, str | None]]:
    """The models besides the policy whose sequences split with the actor's groups (`actor.sequence_parallel_size`
    > 1: the reference, critic and teacher on exactly the actor's ranks): name -> (the key naming its own
    model, that model's path; None: a copy of the actor's)."""
    if config.actor.sequence_parallel_size == 1 or mapping is None:
        return {}
    own = {"ref": ("reference", "ref.path", config.ref.path), "critic": ("critic", "critic.path", config.critic.path),
           "teacher": ("teacher", "algorithm.distill.teacher_path", config.algorithm.distill.teacher_path)}
    return {name: (key, path) for role, (name, key, path) in own.items()
            if role in mapping.roles and mapping.ranks(role) == mapping.ranks("actor")}


def check_sequence_parallel(config: RunConfig, kind: str, actor_ranks: int, model_path: str | None, *,
                            others: dict[str, tuple[str, str | None]] | None = None,
                            facts: dict[str, Any] | None = None) -> tuple[list[VerlError], str | None]:
    """`actor.sequence_parallel_size` against the actor's ranks and the model's attention (heads, sliding
    window, architecture), read off its config (no weights), and against the own models of the `others` that
    split with the actor's groups (`splitting_roles`); and what it does, for `verl check`. The trainer's
    start-up repeats the model part on the loaded models (`enable_sequence_parallel`), for a model passed in
    Python. The RL actor (with a reference, critic and teacher on its ranks), SFT and DPO split sequences; the
    reward-model trainer (one score per sequence) does not, and is refused (the demo's SFT warm start runs
    whole sequences)."""
    size = config.actor.sequence_parallel_size
    if size == 1:
        return [], None
    key = f"actor.sequence_parallel_size={size}"
    if kind == "rm":
        return [ConfigError(f"{key} with trainer.kind=rm: the reward-model trainer scores whole sequences and does "
                            "not split them. Fix: set actor.sequence_parallel_size=1")], None
    facts = read_model_facts(config, model_path) if facts is None else facts
    problems = [ConfigError(p) for p in sequence_parallel_problems(size, actor_ranks=actor_ranks, **facts)]
    others = others or {}
    for name, (own_key, path) in others.items():
        problems += [ConfigError(f"{own_key} (the {name}, on the actor's ranks, splits its sequences with the "
                                 f"actor's groups): {p}")
                     for p in sequence_parallel_problems(size, **read_model_facts(config, path))] if path else []
    note = None if problems else describe_sequence_parallel(size, actor_ranks, facts.get("num_heads"),
                                                             facts.get("num_kv_heads"), kind=kind)
    if note is not None and others:
        names = list(others)
        joined = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        note += f"; the {joined}, on the actor's ranks, split{'s' if len(names) == 1 else ''} sequences the same way"
    return problems, note


def gpus_per_node(config: RunConfig, device_type: str, world_size: int, nodes: int) -> int | None:
    """The GPUs a node has (None on CPU): this machine's, or, checking a GPU run where there is none (a login
    node), `devices.num_gpus_per_node` or one per process, so that the mapping is checked as it will run."""
    if device_type != "cuda":
        return None
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return config.devices.num_gpus_per_node or max(world_size // max(nodes, 1), 1)


def host_memory_checks(config: RunConfig, kind: str, model_path: str | None, device_type: str, world_size: int,
                       nodes: int | None, *, cfg: Any = None) -> list[VerlError]:
    """Tokens within the model's positions, and the host-memory plan (`verl.trainer.checks.host_memory`): the whole
    step on a CPU run, the step's sequences on a GPU run."""
    cfg = text_config(config, model_path) if cfg is None else cfg
    problems = check_positions(config, kind, model_path, cfg)
    on_gpu = targets_gpu(config, device_type)
    return problems + check_host_memory(config, kind, model_path, cfg=cfg, on_gpu=on_gpu, nodes=max(1, nodes or 1),
                                        processes=max(1, world_size // max(1, nodes or 1)))


def checkpoint_disk_warning(config: RunConfig, counts: dict[str, int], dtypes: dict[str, str | None],
                            trainable: dict[str, int] | None = None) -> list[str]:
    """A warning when the checkpoints the run keeps on disk at once (one: parameters x (weights + AdamW
    moments) of each trained role; save_total_limit of them plus the one being written) exceed the free
    space of the run folder's disk (its nearest existing parent)."""
    one = 0
    for role in TRAINABLE_ROLES:
        n = int(counts.get(role) or 0)
        if n <= 0:
            continue
        width = bytes_per_element(dtypes.get(role) or "float32", where=f"{role} dtype")
        trained = min(n, int((trainable or {}).get(role, n)))
        one += n * width + OPTIMIZER_STATES["adamw"] * trained * width
    c, steps = config.checkpoint, config.trainer.total_steps
    saves = (steps // c.save_interval if c.save_interval else 0) + 1  # every save_interval steps and the last
    kept = min(saves, c.save_total_limit + 1) if c.save_total_limit else saves  # + the one being written
    kept += 1 if c.keep_best and c.save_total_limit and saves > kept else 0  # the best is kept apart
    folder = Path(config.trainer.run_dir or "runs").expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return []
    if one == 0 or one * kept <= free:
        return []
    gib = 1024 ** 3
    limit = (f"checkpoint.save_total_limit={c.save_total_limit} plus the one being written" if c.save_total_limit
             else "checkpoint.save_total_limit unset keeps every save")
    return [f"disk: a checkpoint is about {one / gib:.2f} GiB (weights + optimizer state), and up to {kept} are on "
            f"disk at once ({limit}): {one * kept / gib:.2f} GiB, but {folder} has {free / gib:.2f} GiB free; the "
            "run would stop with a full disk. Fix: set checkpoint.save_total_limit lower, free space, or put "
            "trainer.run_dir on a larger disk."]


@dataclass
class CheckPass:
    """What every start-up check reads: the run, where it runs, the report so far (the device mapping once the
    first check made it) and the policy's facts, read once for all of them."""

    config: RunConfig
    kind: str
    world_size: int
    device_type: str
    nodes: int
    model_path: str | None
    runs_split: bool
    report: StartupReport
    facts: PolicyFacts
    lora: Any = None  # lora_checks.LoraCheck, for the memory estimate

    @property
    def actor_ranks(self) -> int:
        return len(self.report.mapping.ranks("actor")) if self.report.mapping is not None else self.world_size

    @property
    def dp_ranks(self) -> int:
        """The actor's data-parallel replicas: its ranks, or its tensor-parallel groups (each reads one share of
        the rows)."""
        tp = self.config.actor.tensor_parallel_size
        return self.actor_ranks // tp if tp > 1 and self.actor_ranks % tp == 0 else self.actor_ranks


def _device_mapping(c: CheckPass) -> list[VerlError]:
    config, kind = c.config, c.kind
    c.report.mapping = validate_device_mapping(
        config.devices, world_size=c.world_size, algorithm_needs_critic=config.needs_critic and kind == "rl",
        needs_ref=config.needs_ref or (kind == "dpo"), needs_reward_model=bool(config.reward.model_path),
        needs_teacher=config.needs_teacher and kind == "rl", is_async=config.is_async and kind == "rl",
        role_dtypes=role_dtype_names(config, c.device_type),
        visible_devices=gpus_per_node(config, c.device_type, c.world_size, c.nodes),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), nodes=c.nodes)
    return []


def _precision(c: CheckPass) -> list[VerlError]:
    """The RL step's notes (correction, distillation, asynchronous rollout, vLLM memory), then fp16 on CPU or
    bf16 on a GPU without it, refused before the weights are read."""
    config, mapping = c.config, c.report.mapping
    try:
        precision = resolve_precision(config, c.device_type)
    except VerlError:
        return []  # an unknown spelling: the mapping check reports it with its key
    if c.kind == "rl":
        notes = c.report.rl_notes
        notes.append(plan_old_logprobs(config, precision.compute).describe())
        notes.append(plan_correction(config, precision.compute).describe())
        notes += [describe_distillation(config.algorithm.distill)] if config.needs_teacher else []
        if mapping is not None and (config.is_async or "max_staleness" in config.rollout.model_fields_set):
            notes.append(describe_async(config, mapping))
        vllm_memory = (describe_vllm_memory(
            config.rollout.engine, config.rollout.vllm.gpu_memory_utilization,
            config.rollout.vllm.rollout_rank_gpu_memory_utilization, mapping.ranks("rollout"))
            if mapping is not None and config.is_async else None)
        notes += [vllm_memory] if vllm_memory else []
    check_dtype_for_device(precision.master, c.device_type, where="model.dtype")
    return check_master_precision(config, precision, c.kind)


def _placement(c: CheckPass) -> list[VerlError]:
    config, mapping = c.config, c.report.mapping
    refusal = split_refusal(c.kind, mapping, c.world_size, c.runs_split)
    problems: list[VerlError] = [refusal] if refusal is not None else []
    problems += check_filter_groups_placement(config, mapping) if c.kind == "rl" else []
    problems += check_demo_placement(config, mapping, c.world_size)
    problems += (check_vllm_placement(config.rollout.engine, mapping.ranks("actor"), c.world_size,
                                      mapping.ranks("rollout") if config.is_async else ())
                 if c.kind == "rl" else [])
    return problems


def _batch_plans(c: CheckPass) -> list[VerlError]:
    mapping = c.report.mapping
    critic_ranks = len(mapping.ranks("critic")) if mapping is not None and "critic" in mapping.roles else None
    c.report.plans = plans_for(c.config, c.dp_ranks, critic_ranks, kind=c.kind)
    return []


def _tensor_parallel(c: CheckPass) -> list[VerlError]:
    problems = tensor_parallel_problems(c.config, c.kind, actor_ranks=c.actor_ranks, mapping=c.report.mapping,
                                        hf_config=c.facts.hf_config)
    note = None if problems else describe_tensor_parallel(c.config, c.actor_ranks)
    c.report.rl_notes += [note] if note else []
    return problems


def _fsdp(c: CheckPass) -> list[VerlError]:
    config = c.config
    c.report.fsdp_notes = config.fsdp.check(c.actor_ranks, uses_lora=uses_lora(config),
                                            num_gpus_per_node=config.devices.num_gpus_per_node,
                                            device_type=c.device_type)
    c.report.fsdp_notes += fsdp_launch(config, world_size=c.world_size, device_type=c.device_type).lines
    return []


def _sequence_parallel(c: CheckPass) -> list[VerlError]:
    # (DPO's reference shares its ranks and splits too; SFT has no other model)
    others = splitting_roles(c.config, c.report.mapping) if c.kind in ("rl", "dpo") else {}
    problems, note = check_sequence_parallel(c.config, c.kind, c.actor_ranks, c.model_path, others=others,
                                             facts=c.facts.attention)
    c.report.rl_notes += [note] if note else []
    return problems


def _packing(c: CheckPass) -> list[VerlError]:
    note = describe_remove_padding(c.config, c.facts.attention)
    c.report.rl_notes += [note] if note else []
    return []


def _sandbox(c: CheckPass) -> list[VerlError]:
    problems, note = check_sandbox(c.config)
    c.report.rl_notes += [note] if note else []
    return problems


def _lora(c: CheckPass) -> list[VerlError]:
    c.lora = check_lora(c.config, model_path=c.model_path, mapping=c.report.mapping, kind=c.kind,
                        model=c.facts.meta_model)
    c.report.parameters = c.lora.counts
    return c.lora.problems


@dataclass(frozen=True)
class Check:
    """One start-up check: its name, the trainer kinds it applies to, and the function (a `CheckPass` in,
    problems out; a `VerlError` it raises is a problem too). `needs_mapping`: skipped when the device
    mapping could not be made (its problem is already reported)."""

    name: str
    kinds: frozenset[str]
    run: Callable[[CheckPass], list[VerlError]]
    needs_mapping: bool = False


ALL_KINDS = frozenset({"rl", "sft", "dpo", "rm"})
RL = frozenset({"rl"})

# Every check, in the order its problems are reported. The names look up the checks at call time (a test may
# replace one, e.g. `check_rollout_engine`).
CHECKS: tuple[Check, ...] = (
    Check("device mapping", ALL_KINDS, _device_mapping),
    Check("precision", ALL_KINDS, _precision),
    Check("rollout engine", RL, lambda c: check_rollout_engine(c.config.rollout.engine, device_type=c.device_type)),
    Check("agent", RL, lambda c: agent_problems(c.config)),
    Check("placement", ALL_KINDS, _placement, needs_mapping=True),
    Check("batch plans", ALL_KINDS, _batch_plans),
    Check("fsdp", ALL_KINDS, _fsdp),
    Check("demo recipe", ALL_KINDS, lambda c: check_demo_env(c.config)),
    Check("environment data", ALL_KINDS, lambda c: check_env_data(c.config, c.kind)),
    Check("response length", ALL_KINDS, lambda c: check_response_length(c.config, c.kind)),
    Check("offline options", ALL_KINDS, lambda c: check_offline_options(c.config, c.kind)),
    Check("sequence parallelism", ALL_KINDS, _sequence_parallel),
    Check("tensor parallelism", ALL_KINDS, _tensor_parallel),
    Check("packed sequences", RL, _packing),
    Check("images", frozenset({"rl", "sft", "dpo"}),
          lambda c: check_images(c.config, c.kind, c.facts.hf_config, c.report.mapping)),
    Check("overlong buffer", RL, lambda c: check_overlong_buffer(c.config)),
    Check("old log-probs", RL, lambda c: check_old_logprobs(c.config)),
    Check("validation samples", RL, lambda c: check_val_n(c.config)),
    Check("keep best", ALL_KINDS, lambda c: check_keep_best(c.config, c.kind)),
    Check("stop when", ALL_KINDS, lambda c: check_stop_when(c.config, c.kind)),
    Check("sizes and host memory", ALL_KINDS, lambda c: host_memory_checks(
        c.config, c.kind, c.model_path, c.device_type, c.world_size, c.nodes, cfg=c.facts.text_config)),
    Check("logging backends", ALL_KINDS, lambda c: backend_problems(c.config.logging.backends)),
    Check("run folder", ALL_KINDS, lambda c: check_run_dir(c.config)),
    Check("sandbox", ALL_KINDS, _sandbox),
    Check("lora", ALL_KINDS, _lora),
)


def check_startup(config: RunConfig, *, world_size: int, model_path: str | None = None,
                  device_type: str | None = None, kind: str | None = None,
                  runs_split_placements: bool | None = None, nodes: int | None = None) -> StartupReport:
    """Every check that needs no weights (`CHECKS`, then the memory estimate); the problems are collected in
    the report, not raised.

    `nodes` is the node count of the launch (`--nnodes`); without it, it is what torchrun tells a worker
    (WORLD_SIZE / LOCAL_WORLD_SIZE). The launching process has no LOCAL_WORLD_SIZE, so `verl train --nproc 8
    --nnodes 8` must pass it, else each node would seem to hold all 64 processes.

    `kind` is the trainer that will run (default `trainer.kind`; the demo's warm start runs SFT on an
    RL config). `runs_split_placements` says whether that trainer runs roles on different ranks (default:
    only RL does).
    """
    kind = kind or config.trainer.kind
    if nodes is None:
        nodes = max(1, world_size // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    c = CheckPass(config, kind, world_size, device_type or ("cuda" if torch.cuda.is_available() else "cpu"), nodes,
                  model_path, kind == "rl" if runs_split_placements is None else runs_split_placements,
                  StartupReport(world_size=world_size), PolicyFacts(config, model_path))
    for check in CHECKS:
        if kind not in check.kinds or (check.needs_mapping and c.report.mapping is None):
            continue
        try:
            c.report.problems += check.run(c)
        except VerlError as exc:
            c.report.problems.append(exc)
    _memory_estimate(c)
    return c.report


def _memory_estimate(c: CheckPass) -> None:
    """Parameter counts, the GPU memory plan's inputs, and (when no check found a problem) the memory
    estimate and its warnings, into `c.report`."""
    config, report, model_path, device_type, lora = c.config, c.report, c.model_path, c.device_type, c.lora
    problems = report.problems
    if model_path is None or report.mapping is None:
        return
    # The GPU plan is made even when the run is refused here (vLLM on a CPU-only machine): planning the
    # GPUs from a login node is what `verl check` is for.
    planned = c.kind in ("rl", "sft", "dpo") and targets_gpu(config, device_type)
    shape = model_shape(config, model_path, model=c.facts.meta_model) if planned else None
    counts, trainable = None, None
    if lora.counts is not None:
        counts, trainable = memory_counts(config, lora.counts, report.mapping)
    meta = c.facts.meta_model  # built once for the pass (the LoRA check counted it when it found no problem)
    count = lora.counts.total if lora.counts is not None else shape.total_params if shape is not None else (
        sum(p.numel() for p in meta.parameters()) if meta is not None else None)
    if counts is None and count is not None:
        counts = {role: count for role in report.mapping.roles if role != "reward"}
    if counts is not None and "teacher" in counts:  # a teacher of another size than the student
        counts["teacher"] = teacher_parameters(config) or counts["teacher"]
    if shape is not None:
        try:
            report.plan_inputs = plan_inputs(config, mapping=report.mapping, shape=shape, world_size=c.world_size,
                                             counts=counts, trainable=trainable, kind=c.kind)
        except VerlError as exc:
            problems.append(exc)
    if problems:
        return
    if counts is not None:
        report.memory = estimate_memory(counts, role_dtype_names(config, device_type, held=True),
                                        mapping=report.mapping,
                                        sharding=config.fsdp.sharding_strategy if c.world_size > 1 else "NO_SHARD",
                                        hybrid_shard_size=config.fsdp.hybrid_shard_size, trainable_counts=trainable)
        device_bytes = (torch.cuda.get_device_properties(0).total_memory
                        if device_type == "cuda" and torch.cuda.is_available() else None)
        report.memory_warnings = report.memory.check(device_bytes)
        report.memory_warnings += checkpoint_disk_warning(
            config, counts, role_dtype_names(config, device_type, held=True), trainable)
        if report.plan_inputs is not None and device_bytes is not None:
            plan = plan_memory(report.plan_inputs, device_bytes)
            if not plan.fits:
                report.memory_warnings.append(
                    "Memory plan: a step may not fit this GPU.\n" + plan.render()
                    + "\nSettings to try, each with its peaks:\n"
                    + "\n".join(f"  {fix}" for fix in suggestions(report.plan_inputs, device_bytes)))
