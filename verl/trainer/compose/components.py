"""The composition: every part a trainer runs, built once by small ordered `setup_*` functions.

Read `compose()` top to bottom to see a run's start-up (torchtune's recipes are the model):

1. `setup_checks`: every check that needs no weights (`preflight`: devices, batch arithmetic, FSDP rules,
   tokenizer, the model on the meta device, data, environment and rewards); all problems are raised
   together, before any weight loads or a process group forms;
2. `setup_process`: join the process group, seed, take on this rank's roles;
3. `setup_policy`: the policy with the tokenizer the checks loaded;
4. RL only, each on the ranks whose roles need it: `setup_reward_model`, `setup_env`, `setup_reference`,
   `setup_teacher`, `setup_critic`, then FSDP2 sharding, `setup_optimizer` and `setup_engine`;
5. when the loop starts (`loop.fit`): `setup_checkpoints` (and the resume) and `setup_tracker`.

`verl check` runs step 1, which builds the policy with `load_policy_with_report(weights=False)`: the same
loader and checks as step 3, on the meta device. Nothing else loads a model: the check pass hands on what
it built (tokenizer, rows, environment) as the typed `Preflight`, and this module builds the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from verl.batch import RolloutBatch
from verl.checkpoint import CheckpointManager
from verl.config.schema import OptimConfig, RunConfig
from verl.data.datasets import pad_token_id
from verl.distributed.fsdp import apply_fsdp, checkpoint_decoder_layers
from verl.distributed.placement import Placement
from verl.distributed.sequence_parallel import enable_sequence_parallel
from verl.distributed.tensor_parallel import apply_tensor_parallel
from verl.env import build_env
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment
from verl.models.dropout import disable_dropout
from verl.models.hf_loader import load_tokenizer
from verl.models.lora import AdapterOff, base_of
from verl.models.reward_model import RewardModelScorer
from verl.models.sharded_load import is_deferred, materialise, reads_shards
from verl.models.vision import is_vision_language, load_processor
from verl.rewards.manager import configure_rewards
from verl.rollout import RolloutEngine, build_engine
from verl.rollout.async_rollout import AsyncRollout, takes_partial_rollouts
from verl.rollout.engine_check import ROLLOUT_RANK_GPU_MEMORY_UTILIZATION
from verl.tracking import Tracker
from verl.trainer.build.fsdp_launch import fsdp_launch
from verl.trainer.build.models import (
    build_reference,
    given_policy,
    load_frozen,
    load_policy_with_report,
    with_cpu_matmul,
)
from verl.trainer.build.optim import build_optimizer
from verl.trainer.build.setup import (
    ProcessIdentity,
    ProcessSetup,
    frozen_dtype,
    resolve_device,
    setup_process,
)
from verl.trainer.checks.preflight import Given, Preflight, preflight, validation_rewards
from verl.trainer.checks.startup import check_env_options
from verl.trainer.rl.rewards import RewardModelFunction
from verl.utils.cpu_matmul import use_cpu_matmul
from verl.utils.tokenizer_protocol import Tokenizer


@dataclass
class Optimizer:
    """A trainable role's optimizer and learning-rate schedule."""

    optimizer: torch.optim.Optimizer
    scheduler: Any

    def pair(self) -> tuple[torch.optim.Optimizer, Any]:
        return self.optimizer, self.scheduler  # the objects themselves (dataclasses.astuple would copy them)


@dataclass
class Components:
    """What a run is made of. Parts a rank's roles do not need are None (a critic-only rank of a split
    placement holds no policy)."""

    config: RunConfig
    checks: Preflight  # what the weight-free pass found: plans, mapping, rows, warnings
    process: ProcessSetup
    tokenizer: Tokenizer
    policy: torch.nn.Module | None
    processor: Any = None  # a vision-language policy's (images -> pixels and pad tokens), else None
    env: Environment | MultiTurnEnvironment | None = None  # RL: prompts + rewards
    reference: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None  # on-policy distillation (algorithm.distill)
    critic: torch.nn.Module | None = None
    reward_scorer: RewardModelScorer | None = None  # a reward model on ranks of its own
    reward_tokenizer: Tokenizer | None = None  # ... and the tokenizer the actor ranks encode its inputs with
    val_rewards: Any = None  # `reward.val_functions`: what validation scores with instead of the training reward
    actor_optim: Optimizer | None = None
    critic_optim: Optimizer | None = None
    engine: RolloutEngine | None = None
    placement: Placement | None = None

    @property
    def remote_reward_model(self) -> bool:
        return remote_reward_model(self.config, self.process, self.checks)


def remote_reward_model(config: RunConfig, process: ProcessSetup, checks: Preflight) -> bool:
    """A reward model placed on ranks of its own (devices.reward apart from the actor's ranks)."""
    mapping = checks.startup.mapping
    return (process.split and bool(config.reward.model_path) and config.devices.reward is not None
            and mapping.ranks("reward") != mapping.ranks("actor"))


# ---------------------------------------------------------------------------------------------- the steps
def setup_checks(config: RunConfig, identity: ProcessIdentity, device: torch.device, *, kind: str,
                 runs_split: bool, given: Given) -> Preflight:
    """The weight-free pass `verl check` prints; every problem it finds is raised here, together."""
    checks = preflight(config, world_size=identity.world_size, device_type=device.type, kind=kind,
                       runs_split_placements=runs_split, given=given)
    checks.raise_if_problems()
    return checks


def setup_policy(config: RunConfig, checks: Preflight, *, device: torch.device, dtype: torch.dtype,
                 given: Given = Given(), kind: str = "rl", defer: bool = False) -> tuple[torch.nn.Module, Any, Any]:
    """The policy, its tokenizer and, for a vision-language model, its processor: the tokenizer the checks
    loaded and compared with the model's own (the checks ran this loader on the meta device already, so a
    problem here is one only weights show). For `kind="rm"` the model trained is the reward model: the
    policy's backbone with a score head. `defer` (`sharded_start`): built on the meta device; `shard` then
    reads only this rank's part of the weights. A model passed from Python brings its processor from the
    folder it names (`name_or_path`)."""
    if given.model is not None:
        model, tokenizer = given_policy(given.model, given.tokenizer, device, config, reward_head=kind == "rm")
        source = getattr(base_of(model), "name_or_path", None)
        processor = (load_processor(source, tokenizer=tokenizer, trust_remote_code=config.model.trust_remote_code)
                     if is_vision_language(model) and source else None)
        return model, tokenizer, processor
    model, tokenizer, report = load_policy_with_report(config, checks.model_path, device=device, dtype=dtype,
                                                       tokenizer=checks.tokenizer, reward_head=kind == "rm",
                                                       defer=defer)
    report.raise_if_problems()
    return model, tokenizer, report.processor


def setup_reward_model(config: RunConfig, process: ProcessSetup) -> RewardModelScorer:
    """`reward.model_path` as a scorer on this rank's device, in its own dtype."""
    r = config.reward
    scorer = RewardModelScorer(r.model_path, dtype=frozen_dtype(config, process.device.type, r.model_dtype),
                               device=process.device, trust_remote_code=config.model.trust_remote_code,
                               batch_size=r.model_batch_size)
    with_cpu_matmul(config, scorer.model)
    return scorer


def setup_env(config: RunConfig, checks: Preflight, given: Given, reward_functions: Sequence[Any] = ()) -> Any:
    """The environment: the prompts (rows passed in, or the rows the checks read, or the env's own) and
    the reward functions (passed in, or `reward.functions`), plus `reward_functions` (a reward model)."""
    if given.env is not None:
        return given.env
    if checks.env is not None and not reward_functions:
        return checks.env  # the checks built it from the same rows and functions
    train_rows = val_rows = None
    if config.env.name is None:
        train_rows, val_rows = (checks.given_rows, []) if checks.given_rows is not None else checks.data.rows()
    functions = list(given.reward_functions) if given.reward_functions is not None else list(config.reward.functions)
    return build_env(config.env, reward_functions=[*functions, *reward_functions], train_rows=train_rows,
                     val_rows=val_rows, base_dir=config._source_dir, seed=config.trainer.seed,
                     shuffle=config.data.shuffle, rewards_optional=config.env.agent is not None)


def setup_reference(config: RunConfig, policy: torch.nn.Module, tokenizer: Tokenizer, process: ProcessSetup, *,
                    given: torch.nn.Module | None = None, defer: bool | None = None) -> torch.nn.Module:
    """The frozen KL anchor (RL) or DPO's reference: `given` (from Python), else `ref.path`, else the actor's
    initial weights; held in the dtype the actor computes in, split like the policy's rows on the actor's
    ranks and, wherever the actor is sharded, sharded over the reference's ranks. `defer` (default: RL's
    `sharded_start`) builds a copy of a meta-device policy on the meta device too."""
    ref = build_reference(config, policy, tokenizer, device=process.device, dtype=process.frozen_dtype or process.dtype,
                          given=given, defer=sharded_start(config, process) if defer is None else defer)
    if not isinstance(ref, AdapterOff) and on_actor_ranks(config, process, "ref"):
        enable_sequence_parallel(base_of(ref), config.actor.sequence_parallel_size)  # split as the policy's rows
    return shard_frozen(ref, "ref", config, process)


def setup_teacher(config: RunConfig, tokenizer: Tokenizer, process: ProcessSetup) -> torch.nn.Module:
    """The distillation teacher (`algorithm.distill.teacher_path`), frozen, in the dtype a reference is held
    in, sharded over the teacher's ranks wherever the actor is sharded; on the actor's ranks it splits its
    sequences with the actor's groups."""
    teacher = load_frozen(config, config.algorithm.distill.teacher_path, tokenizer,
                          key="algorithm.distill.teacher_path", device=process.device,
                          dtype=process.frozen_dtype or process.dtype, defer=sharded_start(config, process))
    if on_actor_ranks(config, process, "teacher"):
        enable_sequence_parallel(base_of(teacher), config.actor.sequence_parallel_size)  # split as the policy's rows
    return shard_frozen(teacher, "teacher", config, process)


def setup_critic(config: RunConfig, policy: torch.nn.Module, process: ProcessSetup, base_path: str) -> torch.nn.Module:
    """The value model: `critic.path`, else a copy of the actor's backbone (adapters merged); with
    `critic.lora` its backbone trains LoRA adapters and the value head trains in full."""
    from verl.models.critic import ValueModel

    cfg = config.critic
    if cfg.path:
        critic = ValueModel.from_pretrained(cfg.path, dtype=process.dtype,
                                            trust_remote_code=config.model.trust_remote_code,
                                            defer=sharded_start(config, process))
    else:
        critic = ValueModel.from_actor(policy)
    if cfg.lora.enabled:
        critic.add_lora(cfg.lora, base_model_name_or_path=cfg.path or base_path)
    critic = with_cpu_matmul(config, critic if is_deferred(critic) else critic.to(process.device),
                             process.device).train()
    if cfg.disable_dropout:
        disable_dropout(critic)
    if on_actor_ranks(config, process, "critic"):  # the actor's groups split the critic's rows too
        enable_sequence_parallel(critic, config.actor.sequence_parallel_size)
    return critic


def on_actor_ranks(config: RunConfig, process: ProcessSetup, role: str) -> bool:
    """Whether `role` shares the actor's sequence-parallel groups (sequence parallelism on, and the role on
    exactly the actor's ranks), so its forwards split sequences as the policy's do."""
    return (config.actor.sequence_parallel_size > 1 and process.groups is not None
            and process.groups.ranks(role) == process.groups.ranks("actor"))


def shard(module: torch.nn.Module, role: str, config: RunConfig, process: ProcessSetup) -> torch.nn.Module:
    """FSDP2-shard a trainable model over its role's ranks. One process without a group (`fsdp_launch`: no
    option needs FSDP2) applies `fsdp.activation_checkpointing` directly, the only option that applies."""
    if process.groups is None or not needs_fsdp2(role, config, process):
        if is_deferred(module):
            materialise(module, process.device)
        if config.fsdp.activation_checkpointing:
            checkpoint_decoder_layers(base_of(module))
        return module
    if isinstance(base_of(module), FSDPModule):  # sharded already
        return module
    cfg = config.fsdp.model_copy(update={"cpu_offload": config.offloads(role)})  # actor/critic.cpu_offload
    mesh = tensor_parallel_mesh(role, process)
    if mesh is not None:
        return shard_tensor_parallel(module, cfg, mesh, process)
    # A peft wrapper holds no parameters of its own: the Hugging Face model under it is the FSDP root, so
    # the rollout (which runs that model directly) and the peft forward both go through its hooks.
    apply_fsdp(base_of(module), cfg, mesh=process.groups.mesh(role, process.device.type),
               device_type=process.device.type)
    if is_deferred(module):  # built on meta: now each rank reads its shards only
        materialise(module, torch.device("cpu") if cfg.cpu_offload else process.device)
    return module


def tensor_parallel_mesh(role: str, process: ProcessSetup) -> Any:
    """The actor's (dp, tp) mesh for a model of `role` split with the actor (the policy, and a reference on its
    ranks: every role is, with `actor.tensor_parallel_size` > 1); None without tensor parallelism."""
    if process.groups is None or role not in ("actor", "ref"):
        return None
    return process.groups.tensor_parallel_mesh(process.device.type)


def shard_tensor_parallel(module: torch.nn.Module, cfg: Any, mesh: Any, process: ProcessSetup) -> torch.nn.Module:
    """`actor.tensor_parallel_size` > 1: split `module`'s layers over the mesh's tensor-parallel ranks
    (`apply_tensor_parallel`), then FSDP2-shard it over its data-parallel ranks (none with one replica: FSDP
    over one rank only changes kernels). Its linear layers multiply with ATen: the oneDNN path takes whole
    weights, not DTensor shards."""
    model = base_of(module)
    use_cpu_matmul(model, "aten")
    apply_tensor_parallel(model, mesh["tp"])
    if mesh["dp"].size() > 1:
        apply_fsdp(model, cfg, mesh=mesh["dp"], device_type=process.device.type)
    elif cfg.activation_checkpointing:
        checkpoint_decoder_layers(model)
    if is_deferred(model):  # built on meta: now each rank reads its rows and columns only
        materialise(model, torch.device("cpu") if cfg.cpu_offload else process.device)
    return module


def needs_fsdp2(role: str, config: RunConfig, process: ProcessSetup) -> bool:
    """A role on several ranks is sharded; on one rank FSDP2 only changes kernels (its optimizer runs
    unfused on DTensors), so it runs the plain module, as one process does, unless an option needs FSDP2
    there (`fsdp_launch`: mixed precision, CPU offload). A 1-rank role of a split placement then trains
    exactly as one process would."""
    if len(process.groups.ranks(role)) > 1:
        return True
    return fsdp_launch(config, world_size=1, device_type=process.device.type, torchrun=False).own_group


def shard_frozen(module: torch.nn.Module, role: str, config: RunConfig, process: ProcessSetup) -> torch.nn.Module:
    """FSDP2-shard a frozen model (the reference) over its role's ranks, in the dtype it is held in: each rank
    keeps 1/N of it, gathered one layer at a time in the forward. Unsharded where the actor is not (one
    process), and left alone when it is the policy itself (LoRA: the policy with its adapters off)."""
    if (process.groups is None or isinstance(module, AdapterOff) or isinstance(base_of(module), FSDPModule)
            or not needs_fsdp2(role, config, process)):
        return materialise(module, process.device) if is_deferred(module) else module
    cfg = config.fsdp.model_copy(update={"mixed_precision": False, "activation_checkpointing": False,
                                         "sharding_strategy": frozen_strategy(config.fsdp.sharding_strategy)})
    mesh = tensor_parallel_mesh(role, process)
    if mesh is not None:
        return shard_tensor_parallel(module, cfg, mesh, process)
    apply_fsdp(module, cfg, mesh=process.groups.mesh(role, process.device.type), device_type=process.device.type)
    if is_deferred(module):  # built on meta: now each rank reads its shards only
        materialise(module, torch.device("cpu") if cfg.cpu_offload else process.device)
    return module


def sharded_start(config: RunConfig, process: ProcessSetup) -> bool:
    """Whether this rank builds its models on the meta device and reads only its shards of the weights after
    sharding (`verl.models.sharded_load.reads_shards`), instead of loading each whole first."""
    return process.groups is not None and reads_shards(config, world_size=process.world_size, split=process.split,
                                                       actor_ranks=len(process.groups.ranks("actor")))


def frozen_strategy(strategy: str) -> str:
    """A model with no backward gains nothing from keeping its weights gathered after the forward."""
    return "FULL_SHARD" if strategy == "SHARD_GRAD_OP" else strategy


def setup_optimizer(module: torch.nn.Module, cfg: OptimConfig, *, total_steps: int,
                    lr: float | None = None) -> Optimizer:
    return Optimizer(*build_optimizer(module.parameters(), cfg, total_steps=total_steps, lr=lr))


def compose_offline(parts: Components, config: RunConfig, *, lr: float, total_steps: int) -> Optimizer:
    """An offline trainer's (SFT, DPO, reward model) last parts, once its rows are read (SFT's steps count on
    them, DPO's reference may score them first): the policy sharded over the actor's ranks (after any
    reference copy: that starts from full weights) and its optimizer. The optimizer is returned, not stored:
    a warm start on an RL trainer's parts (`runtime.on_parts`) must not replace that trainer's."""
    parts.policy = shard(parts.policy, "actor", config, parts.process)
    return setup_optimizer(parts.policy, config.actor, total_steps=total_steps, lr=lr)


def setup_engine(config: RunConfig, policy: torch.nn.Module, *, rollout_rank: bool = False,
                 dtype: torch.dtype | None = None) -> RolloutEngine:
    """With LoRA the engine runs the model under the peft wrapper: its LoRA layers apply the current
    adapters, so the sampler's log-probs are the training forward's. vLLM gets `rollout.vllm.*`, the run's
    seed and `dtype`, the rollout's compute dtype (the dtype a frozen role is held in): it holds its weights in
    it, and each push is cast to it before it is gathered (`weight_sync.policy_weights`).

    vLLM on an asynchronous rollout rank (`rollout_rank`) has the GPU to itself: it stays awake (no sleep
    mode: nothing else needs the memory between two batches), takes
    `rollout.vllm.rollout_rank_gpu_memory_utilization` (default 0.9) of it, and takes every delivery into its
    own weights (`weight_sync.DeliveryReceiver`), so rollouts push nothing (`fed_by_deliveries`). The rank's Hugging
    Face copy of the policy moves to the CPU first, so the GPU does not hold the weights twice: it is only the
    deliveries' layout (names, shapes, dtypes) and, with LoRA, the base weights the adapters merge into.
    (vLLM's external_launcher gives every rank the smallest KV cache over all ranks, so the actor ranks' share
    still bounds it: `engine_check.describe_vllm_memory`.)"""
    if config.rollout.engine != "vllm":
        return build_engine(config.rollout.engine, base_of(policy), cpu_matmul=config.trainer.cpu_matmul)
    options = {**config.rollout.vllm.model_dump(), "seed": config.trainer.seed,
               "tensor_parallel_size": config.actor.tensor_parallel_size}
    rollout_share = options.pop("rollout_rank_gpu_memory_utilization")
    if dtype is not None:
        options["dtype"] = dtype
    if rollout_rank:
        policy.to("cpu")
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # vLLM sizes its KV cache from the free memory it sees
        options["sleep_mode"] = False
        options["gpu_memory_utilization"] = (ROLLOUT_RANK_GPU_MEMORY_UTILIZATION if rollout_share is None
                                             else rollout_share)
    engine = build_engine(config.rollout.engine, base_of(policy), **options)
    engine.fed_by_deliveries = rollout_rank
    return engine


def setup_checkpoints(config: RunConfig, run_dir: Path, process: ProcessSetup) -> CheckpointManager:
    """The run's checkpoints (`checkpoint.*`): atomic, verified, resumable; each rank writes its shards."""
    c = config.checkpoint
    return CheckpointManager(run_dir, save_interval=c.save_interval, save_total_limit=c.save_total_limit,
                             async_save=c.async_save, rank=process.rank, world_size=process.world_size)


def setup_tracker(config: RunConfig, run_dir: Path, process: ProcessSetup, *, resume_step: int,
                  fresh: bool) -> Tracker:
    """Console, JSONL and the `logging.backends`; only rank 0 writes."""
    log = config.logging
    return Tracker(log.backends, run_dir, config=config.model_dump(mode="json"), total_steps=config.trainer.total_steps,
                   project=log.project, experiment=log.experiment, enabled=process.rank == 0, resume_step=resume_step,
                   fresh=fresh, mlflow_tracking_uri=log.mlflow_tracking_uri)


# ---------------------------------------------------------------------------------------------- the recipe
def compose(config: RunConfig, *, kind: str, runs_split: bool = False, given: Given = Given()) -> Components:
    """Build every part of a `kind` run ("rl", "sft", "dpo", "rm"), in order. The offline trainers read their
    rows first, then take their reference (`setup_reference`) and sharded policy and optimizer
    (`compose_offline`) from here as well: those depend on the rows."""
    identity = ProcessIdentity.from_env()
    device = resolve_device(config.trainer.device, identity.local_rank)
    if config.trainer.cpu_threads is not None:
        torch.set_num_threads(config.trainer.cpu_threads)
    checks = setup_checks(config, identity, device, kind=kind, runs_split=runs_split, given=given)
    process = setup_process(config, checks.startup.mapping, identity, device)
    policy, tokenizer, processor = setup_policy(config, checks, device=process.device, dtype=process.dtype,
                                                given=given, kind=kind,
                                                defer=kind == "rl" and sharded_start(config, process))
    parts = Components(config=config, checks=checks, process=process, tokenizer=tokenizer, policy=policy,
                       processor=processor)
    if kind == "rl":
        compose_rl(parts, given)
    return parts


def compose_rl(parts: Components, given: Given) -> None:
    """The RL roles on this rank. Every rank holds the policy, so the reference and critic start from the
    actor's initial weights; the actor is sharded only after those copies (which, where the policy was built
    on the meta device, `sharded_start`, are meta copies that read the same files when they are sharded)."""
    config, process, roles = parts.config, parts.process, parts.process.roles
    if config.actor.disable_dropout:  # before the ref/critic copies, so they have none either
        disable_dropout(parts.policy)
    remote = parts.remote_reward_model
    local_reward_model = bool(config.reward.model_path) and "actor" in roles and not remote
    reward_functions = ([RewardModelFunction(setup_reward_model(config, process), config.reward.model_weight)]
                        if local_reward_model else [])
    parts.env = setup_env(config, parts.checks, given, reward_functions)
    configure_rewards(parts.env, workers=config.reward.workers, timeout_s=config.reward.timeout_s,
                      executor=config.reward.executor, max_worker_crashes=config.reward.max_worker_crashes,
                      max_rss_mb=config.reward.max_rss_mb)  # the pool
    # an environment passed in, or one with a reward model
    for problem in check_env_options(config, parts.env, parts.tokenizer):
        raise problem
    parts.val_rewards = validation_rewards(config, parts.env)
    if config.needs_ref and "ref" in roles:
        parts.reference = setup_reference(config, parts.policy, parts.tokenizer, process)
    if config.needs_teacher and "teacher" in roles:
        parts.teacher = setup_teacher(config, parts.tokenizer, process)
    if config.needs_critic and "critic" in roles:
        parts.critic = setup_critic(config, parts.policy, process, parts.checks.model_path)
    parts.placement = Placement.create(process.groups, rank=process.rank, world_size=process.world_size,
                                       device=process.device, receive=RolloutBatch.from_fields)
    plans, steps = parts.checks.startup.plans, config.trainer.total_steps
    if "actor" in roles:
        if config.actor.sequence_parallel_size > 1:  # after the reference/critic copies (each made to split, or
            # not, by its own placement)
            enable_sequence_parallel(base_of(parts.policy), config.actor.sequence_parallel_size)
        parts.policy = shard(parts.policy, "actor", config, process)
        parts.actor_optim = setup_optimizer(parts.policy, config.actor, total_steps=steps * config.actor.ppo_epochs
                                            * plans["actor"].num_mini_batches)
        parts.engine = setup_engine(config, parts.policy, dtype=process.frozen_dtype or process.dtype)
    if parts.critic is not None:
        parts.critic = shard(parts.critic, "critic", config, process)
        parts.critic_optim = setup_optimizer(parts.critic, config.critic, total_steps=steps * config.critic.ppo_epochs
                                             * plans["critic"].num_mini_batches)
    if "rollout" in roles:  # asynchronous RL: this rank only samples, from its full copy of the policy
        parts.engine = setup_engine(config, parts.policy, rollout_rank=True,
                                    dtype=process.frozen_dtype or process.dtype)
    if remote:  # scores on its own ranks; the actor ranks only tokenise for it
        parts.reward_tokenizer = load_tokenizer(config.reward.model_path,
                                                trust_remote_code=config.model.trust_remote_code)
        if "reward" in roles:
            parts.reward_scorer = setup_reward_model(config, process)


def async_rollout_for(config: RunConfig, parts: Components, draw: Callable[[], RolloutBatch],
                      generate: Callable[[RolloutBatch], RolloutBatch],
                      decode: Callable[[torch.Tensor, torch.Tensor], list[str]]) -> AsyncRollout | None:
    """The run's asynchronous rollout (`devices.rollout`), or None for a synchronous run."""
    if not config.is_async:
        return None
    # An agent episode's text is more than its tokens decoded (a failed agent's traceback): it travels.
    # The weights travel in the dtype the rollout samples in (the compute dtype a frozen role is held in).
    return AsyncRollout(parts.process.groups, config.rollout.max_staleness, draw, generate, decode, parts.env,
                        parts.process.device, parts.engine, parts.process.frozen_dtype or parts.process.dtype,
                        takes_partial_rollouts(config, parts.env), send_text=config.env.agent is not None,
                        pad_token_id=pad_token_id(parts.tokenizer))


__all__ = ["Components", "Optimizer", "async_rollout_for", "compose", "compose_offline", "compose_rl", "setup_checks",
           "setup_critic", "setup_checkpoints", "setup_engine", "setup_env", "setup_optimizer", "setup_policy",
           "setup_reference", "setup_reward_model", "setup_teacher", "setup_tracker", "shard", "shard_frozen",
           "shard_tensor_parallel", "sharded_start", "tensor_parallel_mesh"]
