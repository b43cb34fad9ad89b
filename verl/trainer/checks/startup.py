"""Start-up validation shared by every trainer and by `verl check`: one check, one place.

Everything here runs before any weights load: batch arithmetic, the role -> device mapping, the FSDP
option rules, the logging backends, a writable run folder and a memory estimate from parameter counts (read off the model config on the meta
device). A run that cannot work fails in seconds with every problem listed, not after the model loaded.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from verl.config.schema import RunConfig
from verl.distributed.mapping import validate_device_mapping
from verl.distributed.memory import OPTIMIZER_STATES, TRAINABLE_ROLES, estimate_memory
from verl.distributed.memory_plan import plan_memory, suggestions
from verl.distributed.sequence_parallel import (
    describe_sequence_parallel,
    model_facts,
    sequence_parallel_problems,
)
from verl.env.registry import SELF_CONTAINED_ENVS
from verl.errors import ConfigError, DeviceMappingError, VerlError, disk_full_cause, disk_full_error
from verl.rollout.engine_check import check_rollout_engine, check_vllm_placement, describe_vllm_memory
from verl.tracking.tracker import backend_problems
from verl.trainer.build.fsdp_launch import fsdp_launch
from verl.trainer.build.models import resolve_model_path
from verl.trainer.build.precision import check_master_precision, resolve_precision, role_dtype_names
from verl.trainer.checks.lora_checks import check_lora, memory_counts, uses_lora
from verl.trainer.checks.memory_inputs import model_shape, plan_inputs, targets_gpu
from verl.trainer.forward.batch_math import plan_rl
from verl.trainer.forward.packing import describe_remove_padding
from verl.trainer.rl.correction import plan_correction
from verl.trainer.rl.distill import describe as describe_distillation
from verl.trainer.rl.evaluation import check_ks, validation_ks
from verl.trainer.rollout.agent_episodes import agent_problems
from verl.trainer.rollout.async_rollout import describe as describe_async
from verl.utils.dtype import bytes_per_element, check_dtype_for_device


@dataclass
class StartupReport:
    """What the weight-free checks worked out (plans, mapping, memory) and every problem they found."""

    world_size: int
    problems: list[VerlError] = field(default_factory=list)
    plans: dict[str, Any] = field(default_factory=dict)
    mapping: Any = None
    fsdp_notes: list[str] = field(default_factory=list)
    rl_notes: list[str] = field(default_factory=list)  # what the RL step will do (e.g. the rollout correction)
    memory: Any = None
    memory_warnings: list[str] = field(default_factory=list)
    plan_inputs: Any = None  # memory_plan.PlanInputs of an RL/SFT/DPO run for GPUs (printed by `verl check`)
    parameters: Any = None  # lora_checks.ParameterCounts: trainable and total parameters (LoRA or not)


def count_parameters(path: str, *, trust_remote_code: bool = False, revision: str | None = None) -> int | None:
    """Parameters of a causal LM from its config alone (meta device: no weights read, no memory used)."""
    if not Path(path).expanduser().exists():
        return None  # a hub id not downloaded yet, or a missing path (the model check reports it)
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except Exception:  # an unreadable path is reported by the model check itself
        return None
    return sum(p.numel() for p in model.parameters())


def teacher_parameters(config: RunConfig) -> int | None:
    """Parameters of the distillation teacher (from its config; None when it cannot be read here)."""
    try:
        path = resolve_model_path(config.algorithm.distill.teacher_path, key="algorithm.distill.teacher_path")
    except VerlError:
        return None
    return count_parameters(path, trust_remote_code=config.model.trust_remote_code)


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


def split_refusal(kind: str, mapping: Any, world_size: int, runs_split: bool) -> DeviceMappingError | None:
    """Only the RL trainer runs roles on different ranks; the offline trainers refuse such a mapping."""
    if runs_split or world_size <= 1 or mapping.is_colocated():
        return None
    return DeviceMappingError(
        f"this mapping places roles on different device groups; it is valid, but the {kind} "
        "trainer runs every role on every rank (colocated, the default; only the RL trainer runs "
        "split placements). Fix: remove devices.actor/critic/ref/reward (and the "
        "--*_device_id(s) flags) to colocate.\n" + mapping.render_table())


# The environment each `trainer.demo` recipe is written for (its warm start reads that environment's data).
DEMO_ENVS = {"arithmetic": "arithmetic", "tool": "calculator", "agent": "calculator", "rlhf": "arithmetic"}


VAL_ONLY_NEEDS_ROWS = ("trainer.val_only=true validates on held-out rows, and this run has none. Fix: set "
                       "data.val_files (or data.val_size to hold rows out of data.train_files)")


def check_demo_env(config: RunConfig) -> list[VerlError]:
    """`trainer.demo` names a recipe for one built-in environment; another built-in one is refused here,
    before anything loads (a user class, `file.py:Class`, is checked by the recipe when it starts). A demo
    cannot be validation only."""
    want = DEMO_ENVS.get(config.trainer.demo or "")
    name = config.env.name
    problems: list[VerlError] = []
    if want is not None and name != want and not (name is not None and ":" in name):
        problems.append(ConfigError(f"trainer.demo={config.trainer.demo} is the recipe for env.name: {want}, but "
                                    f"env.name is {name!r}. Set env.name: {want}, or remove trainer.demo to train "
                                    "this config normally."))
    if config.trainer.demo and config.trainer.val_only:
        problems.append(ConfigError(f"trainer.val_only validates and stops, but trainer.demo={config.trainer.demo} "
                                    "runs a whole demo (warm start, RL, summary; `verl train` without a config "
                                    "file or data files runs the built-in one). Fix: remove one of them, or name "
                                    "your data (data.val_files) or config"))
    return problems


# The demos that run their warm start and evaluations on every rank (the arithmetic one runs them on the actor's
# ranks, `verl.demos.warm_start`, so it takes any placement the RL trainer does).
COLOCATED_DEMOS = ("tool", "agent", "rlhf")


def check_demo_placement(config: RunConfig, mapping: Any, world_size: int) -> list[VerlError]:
    """A demo that needs every role on every rank is refused a split placement here, before anything loads."""
    demo = config.trainer.demo
    if demo not in COLOCATED_DEMOS or world_size <= 1 or mapping.is_colocated():
        return []
    return [DeviceMappingError(
        f"trainer.demo={demo} runs its warm start and its evaluations on every rank, so it cannot place roles on "
        "ranks of their own (devices.rollout/critic/ref/reward/teacher apart from devices.actor). Fix: remove "
        "devices.* (and the --*_device_id(s) flags) to colocate every role on every rank; trainer.demo=arithmetic "
        "(`verl train` without a config) runs split placements, asynchronous rollout ranks included.\n"
        + mapping.render_table())]


def check_env_data(config: RunConfig, kind: str) -> list[VerlError]:
    """Data files next to a built-in environment that makes its own prompts would never be read: refused,
    not silently dropped."""
    files = [*config.data.train_files, *config.data.val_files, *(f for m in config.data.mixture for f in m.files)]
    if kind != "rl" or config.env.name not in SELF_CONTAINED_ENVS or not files:
        return []
    demo = (f" and trainer.demo=null (trainer.demo={config.trainer.demo} runs a built-in demo)"
            if config.trainer.demo else "")
    return [ConfigError(f"env.name={config.env.name} makes its own prompts, so data.train_files/val_files/mixture "
                        f"({', '.join(files)}) would not be read. Fix: set env.name=null{demo} to train on the "
                        "files, or remove data.train_files/val_files/mixture")]


def check_overlong_buffer(config: RunConfig) -> list[VerlError]:
    """The overlong buffer is the end of the rollout's length, so it must be shorter than that length."""
    buffer, length = config.algorithm.overlong_buffer, config.rollout.max_new_tokens
    if buffer < length:
        return []
    return [ConfigError(f"algorithm.overlong_buffer={buffer} must be shorter than rollout.max_new_tokens={length} "
                        "(the penalty starts overlong_buffer tokens before that length). Fix: lower it below "
                        f"{length}, or set 0 to turn it off")]


def check_filter_groups_placement(config: RunConfig, mapping: Any) -> list[VerlError]:
    """Dynamic sampling keeps groups by their rewards on the actor's ranks, so a reward model that scores on
    ranks of its own cannot take part."""
    r = config.reward
    if not (config.algorithm.filter_groups and r.model_path and config.devices.reward is not None
            and mapping.ranks("reward") != mapping.ranks("actor")):
        return []
    return [ConfigError("algorithm.filter_groups needs the rewards on the actor's ranks; a reward model on ranks "
                        f"of its own (devices.reward={config.devices.reward}) is not supported with it: colocate "
                        "the reward model (remove devices.reward) or set algorithm.filter_groups=false")]


def check_env_options(config: RunConfig, env: Any, tokenizer: Any = None) -> list[VerlError]:
    """Options that a built environment rules out (the overlong penalty shapes single-turn rewards), and a
    tool environment's tools against the policy's chat template (`ToolEnv.bind_tokenizer`)."""
    from verl.env.multiturn import is_multiturn

    problems: list[VerlError] = []
    if config.algorithm.overlong_buffer and is_multiturn(env):
        problems.append(ConfigError("algorithm.overlong_buffer shapes single-turn rewards by response length; a "
                                    "multi-turn episode's length is its turns'. Fix: set algorithm.overlong_buffer=0 "
                                    "for this env"))
    if config.rollout.engine != "hf" and is_multiturn(env):  # on the actor's ranks or rollout ranks of their own
        problems.append(ConfigError(f"environment {type(env).__name__} runs multi-turn episodes, which sample on the "
                                    "'hf' rollout engine (each observation is prefilled on its KV cache); rollout."
                                    f"engine={config.rollout.engine} cannot run them. Fix: rollout.engine=hf"))
    if tokenizer is not None and callable(getattr(env, "bind_tokenizer", None)):
        try:
            env.bind_tokenizer(tokenizer)
        except ConfigError as exc:
            problems.append(exc)
    return problems


def read_model_facts(config: RunConfig, model_path: str | None) -> dict[str, Any]:
    """The attention facts of a local model's config (`model_facts`; no weights); {} if there is none to read."""
    if model_path is None or not Path(model_path).expanduser().exists():
        return {}
    try:
        return model_facts(AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code,
                                                      revision=config.model.revision))
    except Exception:  # an unreadable model is reported by the model check itself
        return {}


def splitting_roles(config: RunConfig, mapping: Any) -> dict[str, tuple[str, str | None]]:
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
                            others: dict[str, tuple[str, str | None]] | None = None
                            ) -> tuple[list[VerlError], str | None]:
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
    facts = read_model_facts(config, model_path)
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


def check_offline_options(config: RunConfig, kind: str) -> list[VerlError]:
    """SFT/DPO/reward-model options that contradict each other, refused before the model loads."""
    problems: list[VerlError] = []
    s, p = config.sft, config.dpo
    if kind == "sft" and s.steps is not None and s.epochs is not None:
        problems.append(ConfigError(f"sft.steps={s.steps} and sft.epochs={s.epochs} are both set; set only one "
                                    "(or neither, to train for trainer.total_steps)"))
    if kind == "dpo" and p.label_smoothing and p.loss_type != "sigmoid":
        problems.append(ConfigError(f"dpo.label_smoothing={p.label_smoothing} only applies to dpo.loss_type=sigmoid, "
                                    f"not {p.loss_type!r}; set dpo.label_smoothing=0"))
    if kind == "rm" and config.data.apply_chat_template == "always":
        problems.append(ConfigError("data.apply_chat_template=always with trainer.kind=rm: the reward model reads prompt "
                                    "+ answer as reward.model_path scores them in RL (chat messages through the chat "
                                    "template, plain strings as they are), so templating string rows here would train "
                                    "it on text it never scores. Fix: set data.apply_chat_template=auto, or give the "
                                    "rows as chat messages"))
    return problems


def check_val_n(config: RunConfig) -> list[VerlError]:
    """Several answers per held-out prompt only differ when validation samples; metric@k needs k <= val_n."""
    r = config.rollout
    try:
        check_ks(r.val_n, r.val_k)
    except ConfigError as exc:
        return [exc]
    if config.rollout.val_n == 1 or config.rollout.val_temperature > 0:
        return []
    return [ConfigError(f"rollout.val_n={config.rollout.val_n} answers per held-out prompt would all be the same "
                        "greedy answer (rollout.val_temperature=0). Fix: set rollout.val_temperature (e.g. 0.6 or 1.0) "
                        "or rollout.val_n=1")]


_AT_K = re.compile(r"^val/(?:.+/)?(?P<family>pass|best|maj|mean)@(?P<k>\d+)$")


def gpus_per_node(config: RunConfig, device_type: str, world_size: int, nodes: int) -> int | None:
    """The GPUs a node has (None on CPU): this machine's, or, checking a GPU run where there is none (a login
    node), `devices.num_gpus_per_node` or one per process, so that the mapping is checked as it will run."""
    if device_type != "cuda":
        return None
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return config.devices.num_gpus_per_node or max(world_size // max(nodes, 1), 1)


def check_keep_best(config: RunConfig, kind: str) -> list[VerlError]:
    """`checkpoint.keep_best` compares a validation metric: one validation never logs is refused here (a name
    the metric@k rule rules out), the rest when the first validation shows the names (`KeepBest.check`)."""
    name = config.checkpoint.keep_best
    if name is None:
        return []
    if not name.startswith("val/"):
        return [ConfigError(f"checkpoint.keep_best={name}: only validation metrics (val/...) are compared, at the "
                            "steps that validate. Fix: e.g. checkpoint.keep_best=val/score (or val/pass@1), and "
                            "checkpoint.keep_best_mode=min for a loss")]
    at_k = _AT_K.match(name)
    ks = validation_ks(config.rollout.val_n, config.rollout.val_k)
    if kind != "rl" or at_k is None or int(at_k["k"]) in ks:
        return []
    k = int(at_k["k"])
    logged = ", ".join(f"@{x}" for x in ks) or "none (rollout.val_n=1 and rollout.val_k empty)"
    return [ConfigError(f"checkpoint.keep_best={name}: validation never logs it; its metric@k are {logged}. Fix: "
                        f"add {k} to rollout.val_k (with rollout.val_n >= {k} and rollout.val_temperature > 0), "
                        "or keep another metric")]


def check_response_length(config: RunConfig, kind: str) -> list[VerlError]:
    """`data.max_response_length` sizes SFT/DPO data; an RL response is `rollout.max_new_tokens` long. In
    volcengine/verl `data.max_response_length` is the rollout's length, so a value that is neither our
    default nor `rollout.max_new_tokens` in an RL run is most likely meant for the rollout: refused, not
    silently ignored."""
    length, new_tokens = config.data.max_response_length, config.rollout.max_new_tokens
    default = type(config.data).model_fields["max_response_length"].default
    if kind != "rl" or length in (default, new_tokens):
        return []
    return [ConfigError(f"data.max_response_length={length} does nothing in an RL run (it sizes SFT/DPO data); "
                        f"responses are sampled up to rollout.max_new_tokens={new_tokens} tokens (volcengine/verl "
                        f"calls that data.max_response_length). Fix: set rollout.max_new_tokens={length} and "
                        "remove data.max_response_length")]


def runs_model_code(config: RunConfig) -> bool:
    """Whether this run executes model-written code in verl.sandbox (a code_exec reward, or isolation asked)."""
    return bool(config.sandbox.require) or any(f.get("name") == "code_exec" for f in config.reward.functions)


def check_sandbox(config: RunConfig) -> tuple[list[VerlError], str | None]:
    """Make the `sandbox` section this process's default and say what isolation the host gives (None when the
    run executes no model-written code); a demanded feature the host lacks is a problem naming the fix."""
    if not runs_model_code(config):
        return [], None
    from verl.sandbox import configure

    try:
        return [], configure(python=config.sandbox.python, require=config.sandbox.require).describe()
    except VerlError as exc:
        return [exc], None


def check_run_dir(config: RunConfig) -> list[VerlError]:
    """The run folder must be creatable and writable: found here, not as a traceback from the first write
    after the model loaded (or once per rank). Only a temporary folder is created, and removed, so a check
    leaves nothing behind."""
    given = config.trainer.run_dir
    target = Path(given or "runs").expanduser()  # without run_dir: runs/<kind>-<time> (resolve_run_dir)
    key = f"trainer.run_dir={given}" if given else "the default run folder runs/<kind>-<time> (trainer.run_dir unset)"
    fix = "Fix: set trainer.run_dir to a folder you can write (e.g. under your home or scratch space)"
    existing = target.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [ConfigError(f"{key} cannot be created: {existing} is a file, not a folder. {fix}, or move that file")]
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".verl-write-check-").cleanup()
    except OSError as exc:
        if (cause := disk_full_cause(exc)) is not None:  # disk full at start: one line, with the resume
            return [disk_full_error(cause, f"starting the run: creating a file in {existing}", target)]
        what = "the run folder" if existing == target.absolute() else f"{existing}, where it would be created,"
        return [ConfigError(f"{key} is not writable: {what} refuses new files ({exc.strerror or exc}). {fix}")]
    return []


def host_memory_checks(config: RunConfig, kind: str, model_path: str | None, device_type: str, world_size: int,
                       nodes: int | None) -> list[VerlError]:
    """Tokens within the model's positions, and the host-memory plan (`verl.trainer.checks.host_memory`): the whole
    step on a CPU run, the step's sequences on a GPU run."""
    from verl.trainer.checks.host_memory import check_host_memory, check_positions, text_config

    cfg = text_config(config, model_path)
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


def check_startup(config: RunConfig, *, world_size: int, model_path: str | None = None,
                  device_type: str | None = None, kind: str | None = None,
                  runs_split_placements: bool | None = None, nodes: int | None = None) -> StartupReport:
    """Every check that needs no weights; the problems are collected in the report, not raised.

    `nodes` is the node count of the launch (`--nnodes`); without it, it is what torchrun tells a worker
    (WORLD_SIZE / LOCAL_WORLD_SIZE). The launching process has no LOCAL_WORLD_SIZE, so `verl train --nproc 8
    --nnodes 8` must pass it, else each node would seem to hold all 64 processes.

    `kind` is the trainer that will run (default `trainer.kind`; the demo's warm start runs SFT on an
    RL config). `runs_split_placements` says whether that trainer runs roles on different ranks (default:
    only RL does).
    """
    kind = kind or config.trainer.kind
    runs_split = kind == "rl" if runs_split_placements is None else runs_split_placements
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    report = StartupReport(world_size=world_size)
    problems = report.problems
    dtypes: dict[str, str | None] = {}
    try:
        dtypes = role_dtype_names(config, device_type)
        if nodes is None:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            nodes = max(1, world_size // max(1, local_world))
        report.mapping = validate_device_mapping(
            config.devices, world_size=world_size, algorithm_needs_critic=config.needs_critic and kind == "rl",
            needs_ref=config.needs_ref or (kind == "dpo"), needs_reward_model=bool(config.reward.model_path),
            needs_teacher=config.needs_teacher and kind == "rl", is_async=config.is_async and kind == "rl",
            role_dtypes=dtypes,
            visible_devices=gpus_per_node(config, device_type, world_size, nodes),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), nodes=nodes)
    except VerlError as exc:
        problems.append(exc)
    try:
        precision = resolve_precision(config, device_type)
    except VerlError:
        precision = None  # an unknown spelling: the mapping check above reports it with its key
    if precision is not None and kind == "rl":
        report.rl_notes.append(plan_correction(config, precision.compute).describe())
        report.rl_notes += [describe_distillation(config.algorithm.distill)] if config.needs_teacher else []
        if report.mapping is not None and (config.is_async or "max_staleness" in config.rollout.model_fields_set):
            report.rl_notes.append(describe_async(config, report.mapping))
        vllm_memory = (describe_vllm_memory(
            config.rollout.engine, config.rollout.vllm.gpu_memory_utilization,
            config.rollout.vllm.rollout_rank_gpu_memory_utilization, report.mapping.ranks("rollout"))
            if report.mapping is not None and config.is_async else None)
        report.rl_notes += [vllm_memory] if vllm_memory else []
    if precision is not None:
        try:  # fp16 on CPU, bf16 on a GPU without it: refused before the weights are read
            check_dtype_for_device(precision.master, device_type, where="model.dtype")
            problems += check_master_precision(config, precision, kind)
        except VerlError as exc:
            problems.append(exc)
    problems += check_rollout_engine(config.rollout.engine, device_type=device_type) if kind == "rl" else []
    problems += agent_problems(config) if kind == "rl" else []
    if report.mapping is not None:
        refusal = split_refusal(kind, report.mapping, world_size, runs_split)
        if refusal is not None:
            problems.append(refusal)
        problems += check_filter_groups_placement(config, report.mapping) if kind == "rl" else []
        problems += check_demo_placement(config, report.mapping, world_size)
        problems += (check_vllm_placement(config.rollout.engine, report.mapping.ranks("actor"), world_size,
                                          report.mapping.ranks("rollout") if config.is_async else ())
                     if kind == "rl" else [])
    actor_ranks = len(report.mapping.ranks("actor")) if report.mapping is not None else world_size
    critic_ranks = (len(report.mapping.ranks("critic"))
                    if report.mapping is not None and "critic" in report.mapping.roles else None)
    try:
        report.plans = plans_for(config, actor_ranks, critic_ranks, kind=kind)
    except VerlError as exc:
        problems.append(exc)
    try:
        report.fsdp_notes = config.fsdp.check(actor_ranks, uses_lora=uses_lora(config),
                                              num_gpus_per_node=config.devices.num_gpus_per_node,
                                              device_type=device_type)
        report.fsdp_notes += fsdp_launch(config, world_size=world_size, device_type=device_type).lines
    except VerlError as exc:
        problems.append(exc)
    problems += check_demo_env(config) + check_env_data(config, kind) + check_response_length(config, kind)
    problems += check_offline_options(config, kind)
    # (DPO's reference shares its ranks and splits too; SFT has no other model)
    sp_problems, sp_note = check_sequence_parallel(
        config, kind, actor_ranks, model_path, others=splitting_roles(config, report.mapping) if kind in ("rl", "dpo") else {})
    problems += sp_problems
    report.rl_notes += [sp_note] if sp_note else []
    packing = describe_remove_padding(config, read_model_facts(config, model_path)) if kind == "rl" else None
    report.rl_notes += [packing] if packing else []
    problems += check_overlong_buffer(config) + check_val_n(config) if kind == "rl" else []
    problems += check_keep_best(config, kind)
    problems += host_memory_checks(config, kind, model_path, device_type, world_size, nodes)
    problems += backend_problems(config.logging.backends) + check_run_dir(config)
    sandbox_problems, sandbox_note = check_sandbox(config)
    problems += sandbox_problems
    report.rl_notes += [sandbox_note] if sandbox_note else []
    lora = check_lora(config, model_path=model_path, mapping=report.mapping, kind=kind)
    problems += lora.problems
    report.parameters = lora.counts
    if model_path is None or report.mapping is None:
        return report
    # The GPU plan is made even when the run is refused here (vLLM on a CPU-only machine): planning the
    # GPUs from a login node is what `verl check` is for.
    planned = kind in ("rl", "sft", "dpo") and targets_gpu(config, device_type)
    shape = model_shape(config, model_path) if planned else None
    counts, trainable = None, None
    if lora.counts is not None:
        counts, trainable = memory_counts(config, lora.counts, report.mapping)
    count = lora.counts.total if lora.counts is not None else shape.total_params if shape is not None else (
        count_parameters(model_path, trust_remote_code=config.model.trust_remote_code,
                         revision=config.model.revision))
    if counts is None and count is not None:
        counts = {role: count for role in report.mapping.roles if role != "reward"}
    if counts is not None and "teacher" in counts:  # a teacher of another size than the student
        counts["teacher"] = teacher_parameters(config) or counts["teacher"]
    if shape is not None:
        try:
            report.plan_inputs = plan_inputs(config, mapping=report.mapping, shape=shape, world_size=world_size,
                                             counts=counts, trainable=trainable, kind=kind)
        except VerlError as exc:
            problems.append(exc)
    if problems:
        return report
    if counts is not None:
        report.memory = estimate_memory(counts, role_dtype_names(config, device_type, held=True),
                                        mapping=report.mapping,
                                        sharding=config.fsdp.sharding_strategy if world_size > 1 else "NO_SHARD",
                                        hybrid_shard_size=config.fsdp.hybrid_shard_size, trainable_counts=trainable)
        device_bytes = (torch.cuda.get_device_properties(0).total_memory
                        if device_type == "cuda" and torch.cuda.is_available() else None)
        report.memory_warnings = report.memory.check(device_bytes)
        report.memory_warnings += checkpoint_disk_warning(config, counts, role_dtype_names(config, device_type, held=True),
                                                          trainable)
        if report.plan_inputs is not None and device_bytes is not None:
            plan = plan_memory(report.plan_inputs, device_bytes)
            if not plan.fits:
                report.memory_warnings.append(
                    "Memory plan: a step may not fit this GPU.\n" + plan.render()
                    + "\nSettings to try, each with its peaks:\n"
                    + "\n".join(f"  {fix}" for fix in suggestions(report.plan_inputs, device_bytes)))
    return report
