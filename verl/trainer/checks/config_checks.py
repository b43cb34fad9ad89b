"""Start-up checks of the config alone (and, for `check_env_options`, the built environment): options that
contradict each other, demos and their placements, the run folder, the sandbox. No model is read."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from verl.config.run_settings import parse_stop_rule
from verl.config.schema import RunConfig
from verl.distributed.mapping import DeviceMapping
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment
from verl.env.registry import SELF_CONTAINED_ENVS
from verl.errors import ConfigError, DeviceMappingError, VerlError, disk_full_cause, disk_full_error
from verl.trainer.rl.evaluation import check_ks, validation_ks
from verl.utils.tokenizer_protocol import Tokenizer


def split_refusal(kind: str, mapping: DeviceMapping, world_size: int, runs_split: bool) -> DeviceMappingError | None:
    """Only the RL trainer runs roles on different ranks; the offline trainers refuse such a mapping."""
    if runs_split or world_size <= 1 or mapping.is_colocated():
        return None
    return DeviceMappingError(
        f"this mapping places roles on different device groups; it is valid, but the {kind} "
        "trainer runs every role on every rank (colocated, the default; only the RL trainer runs "
        "split placements). Fix: remove devices.actor/critic/ref/reward (and the "
        "--*_device_id(s) flags) to colocate.\n" + mapping.render_table())

# The environment each `trainer.demo` recipe is written for (its warm start reads that environment's data).
DEMO_ENVS = {"arithmetic": "arithmetic", "tool": "calculator", "agent": "calculator", "rlhf": "arithmetic",
             "vision": "shapes"}

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

def check_demo_placement(config: RunConfig, mapping: DeviceMapping | None, world_size: int) -> list[VerlError]:
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

def check_old_logprobs(config: RunConfig) -> list[VerlError]:
    """The sampler's log-probs are the old policy's only where it samples from the policy's own distribution."""
    rollout = config.rollout
    if config.actor.old_logprobs != "sampler" or not rollout.filters:
        return []
    return [ConfigError(f"actor.old_logprobs=sampler with rollout.top_k={rollout.top_k}, rollout.top_p="
                        f"{rollout.top_p}: the sampler's log-probs are those of the filtered, renormalised "
                        "distribution, not the policy's, so PPO's ratio against them would be biased. Fix: "
                        "actor.old_logprobs=recompute (or auto), or sample without top-k/top-p")]


def check_filter_groups_placement(config: RunConfig, mapping: DeviceMapping | None) -> list[VerlError]:
    """Dynamic sampling keeps groups by their rewards on the actor's ranks, so a reward model that scores on
    ranks of its own cannot take part."""
    r = config.reward
    if not (config.algorithm.filter_groups and r.model_path and config.devices.reward is not None
            and mapping.ranks("reward") != mapping.ranks("actor")):
        return []
    return [ConfigError("algorithm.filter_groups needs the rewards on the actor's ranks; a reward model on ranks "
                        f"of its own (devices.reward={config.devices.reward}) is not supported with it: colocate "
                        "the reward model (remove devices.reward) or set algorithm.filter_groups=false")]


def check_env_options(config: RunConfig, env: Environment | MultiTurnEnvironment,
                      tokenizer: Tokenizer | None = None) -> list[VerlError]:
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
        problems.append(ConfigError(
            "data.apply_chat_template=always with trainer.kind=rm: the reward model reads prompt "
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
    return _unlogged_at_k(config, kind, "checkpoint.keep_best", name, "or keep another metric")


def check_stop_when(config: RunConfig, kind: str) -> list[VerlError]:
    """`trainer.stop_when` is read at the validations after a step: a metric no validation logs, or a run that
    validates only at its end (where it stops anyway), would make it a rule that never acts."""
    rule = config.trainer.stop_when
    if rule is None:
        return []
    name = parse_stop_rule(rule)[0]
    if not name.startswith("val/"):
        return [ConfigError(f"trainer.stop_when={rule}: only validation metrics (val/...) are read, at the steps "
                            "that validate. Fix: e.g. trainer.stop_when='val/accuracy>=0.97'")]
    if config.trainer.val_every == 0:
        return [ConfigError(f"trainer.stop_when={rule} is read when the run validates, and trainer.val_every=0 "
                            "validates only after the last step. Fix: set trainer.val_every (e.g. 50)")]
    return _unlogged_at_k(config, kind, "trainer.stop_when", name, "or name another metric")


def _unlogged_at_k(config: RunConfig, kind: str, key: str, name: str, other: str) -> list[VerlError]:
    """A metric@k (val/pass@4) that an RL run's validation never logs, as the error for `key`."""
    at_k = _AT_K.match(name)
    ks = validation_ks(config.rollout.val_n, config.rollout.val_k)
    if kind != "rl" or at_k is None or int(at_k["k"]) in ks:
        return []
    k = int(at_k["k"])
    logged = ", ".join(f"@{x}" for x in ks) or "none (rollout.val_n=1 and rollout.val_k empty)"
    return [ConfigError(f"{key}={name}: validation never logs it; its metric@k are {logged}. Fix: "
                        f"add {k} to rollout.val_k (with rollout.val_n >= {k} and rollout.val_temperature > 0), "
                        f"{other}")]

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
