"""A volcengine/verl command line (`python -m verl.trainer.main_ppo key=value ...`, or its SFT trainer's) read
as ours.

Each `key=value` is sorted into one of three kinds, and none is applied silently:
  * the same setting here: our key with the user's value (`actor_rollout_ref.actor.optim.lr` -> `actor.lr`,
    our own keys kept as they are, `custom_reward_function.path/name` -> one `reward.functions` entry,
    `data.max_response_length` -> `rollout.max_new_tokens`, which is what verl means by it, `use_kl_loss` and
    `kl_loss_coef` -> `actor.kl_loss_coef`, `data.filter_overlong_prompts` -> `data.truncation=drop`,
    `trainer.n_gpus_per_node` -> `--nproc`);
  * a setting whose meaning differs (a count, a unit, an on/off switch that is a value here): named with
    ours and what to decide (`VERL_KEYS`' notes);
  * a key with nothing here (vLLM memory fractions, Ray, Megatron): listed.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from verl.compat.keys import VERL_KEYS, VERL_SFT_KEYS
from verl.config.loader import parse_value
from verl.config.schema import RunConfig

_PLAIN_KEY = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")
_ARR = "actor_rollout_ref"
# main_ppo keys whose setting is another key here (data.max_response_length is ours too, for SFT/DPO data)
_RENAMED = {"data.max_response_length": "rollout.max_new_tokens", "data.prompt_key": "data.fields.prompt",
            "data.image_key": "data.fields.images"}
# verl keys whose values map onto one of ours: (our key, their value -> ours, what to decide for other values)
_VALUES: dict[str, tuple[str, dict[str, str], str]] = {
    "data.truncation": ("data.truncation", {"error": "error", "left": "truncate_left"},
                        "data.truncation (error, drop or truncate_left)"),
    f"{_ARR}.rollout.name": ("rollout.engine", {"hf": "hf", "vllm": "vllm"}, "rollout.engine (hf or vllm)"),
    # bypass mode: the rollout's log-probs are the old policy (no recomputing pass)
    "algorithm.rollout_correction.bypass_mode": ("actor.old_logprobs", {"true": "sampler", "True": "sampler",
                                                                       "false": "recompute", "False": "recompute"},
                                                 "actor.old_logprobs (sampler, recompute or auto)"),
    # prime's manager scores in a process pool; naive's one sample after another in the driver (threads here)
    "reward_model.reward_manager": ("reward.executor", {"naive": "thread", "prime": "process"},
                                    "reward.executor (thread or process); a batched function is `batched: true` in "
                                    "its reward.functions entry, DAPO's buffer algorithm.overlong_buffer"),
    f"{_ARR}.actor.policy_loss.loss_mode": ("actor.policy_loss", {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo",
                                                                   "geo_mean": "gmpo", "clip_cov": "clip_cov",
                                                                   "kl_cov": "kl_cov"},
                                            "actor.policy_loss (ppo, gspo, cispo, gmpo, clip_cov or kl_cov)"),
}
_REWARD_PATH, _REWARD_NAME = "custom_reward_function.path", "custom_reward_function.name"
_DEFAULT_REWARDS = ("name the functions, routed by data_sources, e.g. 'reward.functions=[{name: numeric_match, "
                    "data_sources: [openai/gsm8k]}, {name: math_verify, data_sources: [lighteval/MATH]}]'")
_USE_KL, _KL_COEF = f"{_ARR}.actor.use_kl_loss", f"{_ARR}.actor.kl_loss_coef"
_OVERLONG, _OVERLONG_LEN = "reward_model.overlong_buffer.enable", "reward_model.overlong_buffer.len"
# the DAPO recipe's test scripts give the same buffer as the DAPO reward manager's kwargs
_CFG = "reward_model.reward_kwargs.overlong_buffer_cfg"
_OVERLONG_ALIASES = {f"{_CFG}.enable": _OVERLONG, f"{_CFG}.len": _OVERLONG_LEN,
                     f"{_CFG}.penalty_factor": "reward_model.overlong_buffer.penalty_factor"}
_MAX_RESP_LEN = "reward_model.reward_kwargs.max_resp_len"
# verl's "-1 = off" where ours is another value: (our key, ours for a negative value, what that does here)
_NEGATIVE: dict[str, tuple[str, str, str]] = {
    "trainer.save_freq": ("checkpoint.save_interval", "0", "no periodic saves; here the final step still saves"),
    "trainer.test_freq": ("trainer.val_every", "0", "no periodic validation; here the end of training still "
                          "validates"),
    f"{_ARR}.rollout.top_k": ("rollout.top_k", "0", "no top-k filter (0 is off here)"),
    f"{_ARR}.actor.tis_imp_ratio_cap": ("actor.tis_cap", "null", "no truncated importance sampling asked for; here "
                                          "actor.rollout_correction.mode=auto decides (on for vLLM and bf16)"),
}
# optim.lr_warmup_steps_ratio: warmup as a share of the run's steps, used where lr_warmup_steps is unset (-1)
_WARMUP = {f"{_ARR}.actor.optim": "actor.warmup_steps", "critic.optim": "critic.warmup_steps"}
_TOTAL_STEPS = "trainer.total_training_steps"
_EPOCHS, _TRAIN_FILES, _BATCH = "trainer.total_epochs", "data.train_files", "data.train_batch_size"
_VERL_BATCH = "1024"  # verl's data.train_batch_size when a script does not set it
# verl's token budgets are per GPU after a Ulysses split (it multiplies them by the sequence-parallel size);
# ours counts a micro-batch's tokens before the split: (budget key, our key, its sequence-parallel size key)
_BUDGETS = ((f"{_ARR}.actor.ppo_max_token_len_per_gpu", "actor.max_tokens_per_micro_batch",
             f"{_ARR}.actor.ulysses_sequence_parallel_size"),
            ("critic.ppo_max_token_len_per_gpu", "critic.max_tokens_per_micro_batch",
             "critic.ulysses_sequence_parallel_size"))
# verl's Megatron tensor-parallel sizes: the actor's is ours; the reference follows the actor's mesh here
_TP_ACTOR = f"{_ARR}.actor.megatron.tensor_model_parallel_size"
_TP_REF = f"{_ARR}.ref.megatron.tensor_model_parallel_size"
_TP_ROLLOUT = f"{_ARR}.rollout.tensor_model_parallel_size"
_FILTER_LONG = "data.filter_overlong_prompts"
_GPUS, _NODES = "trainer.n_gpus_per_node", "trainer.nnodes"
_LAUNCH = (_GPUS, _NODES)


def _true(value: str) -> bool:
    return value.strip().strip("'\"").lower() in ("true", "1", "yes")


def is_our_key(dotted: str) -> bool:
    """Whether `dotted` names a setting of `RunConfig` (any key under a free-form dict field such as
    `env.kwargs` counts)."""
    model: type[BaseModel] = RunConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            return False
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            continue
        return i == len(parts) - 1 or getattr(annotation, "__origin__", None) is dict
    return False


@dataclass
class Translation:
    """`ours`: `key=value` items for `verl train`; `flags`: its launch flags (`--nproc`); `decide`: (their
    item, our key and what differs); `missing`: items with no equivalent here; `notes`: (their item, what the
    translated setting does differently, though it is the nearest here)."""

    ours: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    decide: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)

    def dedupe(self) -> None:
        """One item per key, with the value verl would use (the last given): a command line that sets a key
        twice is hard to read, even where the last one wins."""
        last = {item.partition("=")[0]: i for i, item in enumerate(self.ours)}
        self.ours = [item for i, item in enumerate(self.ours) if last[item.partition("=")[0]] == i]

    def command(self) -> str:
        return " ".join(["verl train", *self.flags, *(shlex.quote(item) for item in self.ours)])


def _sort(items: Sequence[str], keys: Mapping[str, str], combined: Sequence[str],
          renamed: Mapping[str, str]) -> tuple[Translation, dict[str, str]]:
    """Items into ours / decide / missing by `keys` (verl key -> ours, or ours with a note) and `renamed`
    (verl keys that are ours too but mean another of ours); the values of `combined` keys (settings made of
    several verl keys) are returned for the caller to join."""
    out = Translation()
    given: dict[str, str] = {}
    for item in items:
        key, eq, value = item.lstrip("+").partition("=")
        key = _OVERLONG_ALIASES.get(key.strip(), key.strip())
        if not eq or not key or item.startswith("~"):
            out.missing.append(item)
        elif key in combined or key in _LAUNCH:
            given[key] = value
        elif key in _NEGATIVE and _negative(value):
            ours, off, note = _NEGATIVE[key]
            out.ours.append(f"{ours}={off}")
            out.notes.append((item, f"{ours}={off}: {note}"))
        elif key in renamed:
            out.ours.append(f"{renamed[key]}={value}")
        elif key in _VALUES:
            ours, values, note = _VALUES[key]
            theirs = value.strip("'\"")  # Hydra users quote strings
            if theirs in values:
                out.ours.append(f"{ours}={values[theirs]}")
            else:
                out.decide.append((item, note))
        elif key in keys:
            ours = keys[key]
            if _PLAIN_KEY.match(ours) and is_our_key(ours):
                out.ours.append(f"{ours}={value}")
            else:
                out.decide.append((item, ours))
        elif is_our_key(key):
            out.ours.append(f"{key}={value}")
        else:
            out.missing.append(item)
    return out, given


def _negative(value: str) -> bool:
    try:
        return float(value.strip().strip("'\"")) < 0
    except ValueError:
        return False


def _number(value: str | None) -> float | None:
    """`value` read as YAML reads it, if that is a number (None when absent or not a number: the item is then
    left to decide rather than computed with)."""
    parsed = parse_value(value) if value is not None else None
    return float(parsed) if isinstance(parsed, int | float) and not isinstance(parsed, bool) else None


def _warmup(given: Mapping[str, str], out: Translation) -> None:
    """verl's warmup is `lr_warmup_steps`, or where that is unset (-1, its default) `lr_warmup_steps_ratio` of
    the run's steps; ours is a count of steps, computed here when the run's length is given in steps."""
    for section, ours in _WARMUP.items():
        steps, ratio = given.get(f"{section}.lr_warmup_steps"), given.get(f"{section}.lr_warmup_steps_ratio")
        fraction, total = _number(ratio), _number(given.get(_TOTAL_STEPS))
        if steps is not None and not _negative(steps):
            out.ours.append(f"{ours}={steps}")
        elif ratio is not None and (fraction is None or fraction > 0):
            item = f"{section}.lr_warmup_steps_ratio={ratio}"
            if fraction is not None and total is not None:
                count = int(fraction * total)
                out.ours.append(f"{ours}={count}")
                out.notes.append((item, f"{ours}={count}: the ratio of {_TOTAL_STEPS}={given[_TOTAL_STEPS]}"))
            else:
                out.decide.append((item, f"{ours} (a count of steps: the ratio times trainer.total_steps)"))


def count_rows(path: str) -> int | None:
    """Rows of a local training file as verl's dataset reads them (parquet's metadata, JSON lines, a JSON list);
    None where the file is not here or not one of those."""
    import json
    from pathlib import Path

    file = Path(path.strip().strip("'\"")).expanduser()
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(file).metadata.num_rows)
        if file.suffix == ".jsonl":
            with file.open("rb") as lines:
                return sum(1 for line in lines if line.strip())
        if file.suffix == ".json":
            rows = json.loads(file.read_text(encoding="utf-8"))
            return len(rows) if isinstance(rows, list) else None
    except (OSError, ValueError, ImportError):
        return None
    return None


def _epochs(given: Mapping[str, str], items: Sequence[str], out: Translation) -> int | None:
    """verl's run length in epochs: its steps are epochs x (training rows // data.train_batch_size), the
    dataloader dropping the last partial batch. Counted here where the training files are on this machine;
    otherwise the count to make is to decide (without it trainer.total_steps would be our default, 100)."""
    epochs, theirs = _number(given[_EPOCHS]), f"{_EPOCHS}={given[_EPOCHS]}"
    batch_text = next((i.partition("=")[2] for i in reversed(items) if i.lstrip("+").startswith(f"{_BATCH}=")),
                      _VERL_BATCH)
    batch = _number(batch_text)
    files = parse_value(next((i.partition("=")[2] for i in reversed(items)
                              if i.lstrip("+").startswith(f"{_TRAIN_FILES}=")), "[]"))
    files = [str(f) for f in (files if isinstance(files, list) else [files])]
    counts = [count_rows(f) for f in files]
    formula = (f"trainer.total_steps (a count of steps here: {given[_EPOCHS]} epochs x (training rows // "
               f"{_BATCH}={batch_text}), as verl counts them; there is no RL epochs setting)")
    if epochs is None or batch is None or batch <= 0 or not files or None in counts:
        missing = [f for f, n in zip(files, counts, strict=True) if n is None]
        where = f"; {', '.join(missing)} cannot be read here to count its rows" if missing else ""
        out.decide.append((theirs, formula + where))
        return None
    rows = sum(n for n in counts if n is not None)
    if rows < batch:  # verl's dataloader would have no full batch to draw
        out.decide.append((theirs, f"{formula}; {_TRAIN_FILES} holds {rows} rows, fewer than one batch"))
        return None
    steps = int(epochs) * (rows // int(batch))
    out.ours.append(f"trainer.total_steps={steps}")
    out.notes.append((theirs, f"trainer.total_steps={steps}: {int(epochs)} epochs x ({rows} rows in "
                      f"{_TRAIN_FILES} // {_BATCH}={batch_text}), verl's count of steps"))
    return steps


def _tensor_parallel(given: Mapping[str, str], out: Translation) -> None:
    """verl's tensor-parallel sizes: the actor's (Megatron) is ours; the reference and vLLM follow the actor's
    mesh here, so a size of their own is to decide (verl's common FSDP actor with a 2-way vLLM has no match:
    here vLLM is split only with the actor)."""
    actor = given.get(_TP_ACTOR, "1").strip()
    if _TP_ACTOR in given:
        out.ours.append(f"actor.tensor_parallel_size={given[_TP_ACTOR]}")
    if _TP_REF in given and given[_TP_REF].strip() != actor:
        out.decide.append((f"{_TP_REF}={given[_TP_REF]}", "actor.tensor_parallel_size (the reference follows the "
                           "actor's mesh here; it has no size of its own)"))
    if _TP_ROLLOUT in given and given[_TP_ROLLOUT].strip() != actor:
        out.decide.append((f"{_TP_ROLLOUT}={given[_TP_ROLLOUT]}", "actor.tensor_parallel_size (vLLM's engines are "
                           "split as the actor is, so set both, or leave vLLM whole with the actor: one engine "
                           "per GPU)"))


def _sequence_parallel(given: Mapping[str, str], out: Translation) -> None:
    """verl's Ulysses sizes: the actor's is ours (a reference, critic and teacher on the actor's ranks split
    with its groups); a critic size of its own is to decide. A token budget given with a size is verl's per
    GPU after the split, ours the micro-batch's before it: ours is verl's times the size (same micro-batches)."""
    (_, _, actor_key), (_, _, critic_key) = _BUDGETS
    if actor_key in given:
        out.ours.append(f"actor.sequence_parallel_size={given[actor_key]}")
    if critic_key in given and given[critic_key].strip() != given.get(actor_key, "1").strip():
        out.decide.append((f"{critic_key}={given[critic_key]}", "actor.sequence_parallel_size (a critic on the "
                           "actor's ranks splits with the actor's groups; one on ranks of its own runs whole "
                           "sequences)"))
    for budget, ours, size_key in _BUDGETS:
        if budget not in given:
            continue
        size, tokens = _number(given.get(size_key, "1")), _number(given[budget])
        if size is None or tokens is None:
            out.decide.append((f"{budget}={given[budget]}", f"{ours} (a micro-batch's tokens before the Ulysses "
                               f"split: verl's per-GPU figure times {size_key})"))
        elif size > 1:
            total = int(tokens * size)
            out.ours.append(f"{ours}={total}")
            out.notes.append((f"{budget}={given[budget]}", f"{ours}={total}: verl's budget is per GPU after the "
                              f"{size:g}-way split, ours the micro-batch's before it"))
        else:
            out.ours.append(f"{ours}={given[budget]}")


def translate(items: Sequence[str]) -> Translation:
    """A `verl.trainer.main_ppo` (or DAPO recipe `main_dapo`) command line's `key=value` items (Hydra's `+`/`++`
    prefixes allowed), sorted into ours, to decide, and missing; each of our keys appears once."""
    warmup = [f"{section}.{name}" for section in _WARMUP for name in ("lr_warmup_steps", "lr_warmup_steps_ratio")]
    budgets = [key for triple in _BUDGETS for key in (triple[0], triple[2])]
    out, given = _sort(items, VERL_KEYS, (_REWARD_PATH, _REWARD_NAME, _USE_KL, _KL_COEF, _OVERLONG, _OVERLONG_LEN,
                                          _FILTER_LONG, _MAX_RESP_LEN, _TOTAL_STEPS, _EPOCHS, _TP_ACTOR, _TP_REF,
                                          _TP_ROLLOUT, *warmup, *budgets),
                       _RENAMED)
    if _TOTAL_STEPS in given:
        out.ours.append(f"trainer.total_steps={given[_TOTAL_STEPS]}")
    elif _EPOCHS in given:
        steps = _epochs(given, items, out)
        if steps is not None:  # the warm-up ratio below counts these steps, as verl's does
            given = {**given, _TOTAL_STEPS: str(steps)}
    if _REWARD_PATH in given:  # verl's default function name is compute_score
        name = given.get(_REWARD_NAME) or "compute_score"
        out.ours.append(f"reward.functions=[{{name: {given[_REWARD_PATH]}:{name}}}]")
    elif _REWARD_NAME in given:
        out.decide.append((f"{_REWARD_NAME}={given[_REWARD_NAME]}",
                           "reward.functions=[{name: FILE.py:FUNCTION}] (custom_reward_function.path names the file)"))
    if _true(given.get(_USE_KL, "false")):  # verl's KL loss is off unless use_kl_loss; its coefficient 0.001
        out.ours.append(f"actor.kl_loss_coef={given.get(_KL_COEF, '0.001')}")
    elif _KL_COEF in given and _USE_KL in given:  # use_kl_loss=False said so: the loss is off, as by default here
        out.ours.append("actor.kl_loss_coef=0")
        out.notes.append((f"{_KL_COEF}={given[_KL_COEF]}", f"actor.kl_loss_coef=0: {_USE_KL}={given[_USE_KL]} "
                          "turns the KL loss off"))
    elif _KL_COEF in given:
        out.decide.append((f"{_KL_COEF}={given[_KL_COEF]}", "actor.kl_loss_coef (it does nothing in verl without "
                           "use_kl_loss=True; here a value > 0 turns the KL loss on)"))
    if _true(given.get(_OVERLONG, "false")) and _OVERLONG_LEN in given:  # DAPO's overlong reward shaping
        out.ours.append(f"algorithm.overlong_buffer={given[_OVERLONG_LEN]}")
    elif _OVERLONG in given or _OVERLONG_LEN in given:
        theirs = " ".join(f"{k}={given[k]}" for k in (_OVERLONG, _OVERLONG_LEN) if k in given)
        out.decide.append((theirs, "algorithm.overlong_buffer (the buffer's length; > 0 turns it on, and verl "
                                   "needs both enable=True and len)"))
    if _MAX_RESP_LEN in given:  # the DAPO reward manager's length, which the buffer counts back from
        theirs = given[_MAX_RESP_LEN].strip()
        response = next((i.partition("=")[2] for i in reversed(out.ours) if i.startswith("rollout.max_new_tokens=")),
                        None)
        if response is None or response.strip() != theirs:
            out.decide.append((f"{_MAX_RESP_LEN}={theirs}", "rollout.max_new_tokens (the overlong buffer counts "
                               "back from it here; verl's DAPO manager from its own max_resp_len)"))
    if _true(given.get(_FILTER_LONG, "false")):  # verl drops too-long prompts before any truncation: this wins
        out.ours.append("data.truncation=drop")
    _sequence_parallel(given, out)
    _tensor_parallel(given, out)
    _warmup(given, out)
    if not any(k in given for k in (_REWARD_PATH, _REWARD_NAME)) and not any(o.startswith("reward.") for o in out.ours):
        # verl's default scores each sample with a scorer chosen by its data_source; here the functions are named
        out.decide.append(("(no custom_reward_function: verl picks a scorer by data_source)", _DEFAULT_REWARDS))
    _launch(given, out)
    out.dedupe()
    return out


def translate_sft(items: Sequence[str]) -> Translation:
    """A `verl.trainer.fsdp_sft_trainer` command line's items, sorted likewise; the run is an SFT run on
    `data.kind=sft` rows, whose input and output columns verl names with `prompt_key`/`response_key` (plus
    `*_dict_keys` for a field inside a column) and `multiturn.messages_key`."""
    columns = ("data.prompt_key", "data.prompt_dict_keys", "data.response_key", "data.response_dict_keys",
               "data.multiturn.enable", "data.multiturn.messages_key")
    out, given = _sort(items, VERL_SFT_KEYS, columns, {})
    out.ours[:0] = ["trainer.kind=sft", "data.kind=sft"]
    for field_name, side in (("input", "prompt"), ("output", "response")):
        if f"data.{side}_key" in given:
            path = given[f"data.{side}_key"]
            inner = parse_value(given.get(f"data.{side}_dict_keys", "[]"))
            inner = inner if isinstance(inner, list) else [inner]
            out.ours.append(f"data.fields.{field_name}={'.'.join(map(str, [path, *inner[:1]]))}")
    if _true(given.get("data.multiturn.enable", "false")):
        out.ours.append(f"data.fields.messages={given.get('data.multiturn.messages_key', 'messages')}")
    _launch(given, out)
    out.dedupe()
    return out


# volcengine/verl's entry points: module -> the translator of its key=value items. The DAPO recipe's
# main_dapo reads main_ppo's keys plus the recipe's own (data.gen_batch_size, filter_groups), which the
# same table answers.
ENTRY_POINTS = {"verl.trainer.main_ppo": translate, "recipe.dapo.main_dapo": translate,
                "verl.trainer.fsdp_sft_trainer": translate_sft}


def translate_command(argv: Sequence[str]) -> tuple[str, Translation]:
    """A launch line as an upstream script writes it (`python3 -m recipe.dapo.main_dapo k=v ...`, with any
    launcher before it: `ray job submit ... --`, `torchrun --nproc_per_node 8`): its module and translation.
    Without `-m MODULE` the items are main_ppo's. An unknown module is an error naming the known ones."""
    from verl.errors import ConfigError

    argv = list(argv)
    module = "verl.trainer.main_ppo"
    if "-m" in argv:
        at = len(argv) - 1 - argv[::-1].index("-m")
        if at + 1 >= len(argv):
            raise ConfigError("`-m` at the end of the command line: give the module, e.g. -m verl.trainer.main_ppo")
        module, argv = argv[at + 1], argv[at + 2:]
        if module not in ENTRY_POINTS:
            raise ConfigError(f"`-m {module}`: not a volcengine/verl entry point this verl translates; known: "
                              f"{', '.join(ENTRY_POINTS)}")
    return module, ENTRY_POINTS[module](argv)


def _launch(given: Mapping[str, str], out: Translation) -> None:
    """verl's GPUs per node and node count: our launch flags (one process per GPU, as verl starts)."""
    if _GPUS in given:
        out.ours.append(f"devices.num_gpus_per_node={given[_GPUS]}")
        if given[_GPUS].strip() != "1":
            out.flags.append(f"--nproc {given[_GPUS]}")
    if given.get(_NODES, "1").strip() != "1":
        out.flags.append(f"--nnodes {given[_NODES]}")


# Put in place of the run's own values (`cpu_command`), these run it on one CPU in a minute: the tiny
# local model, Hugging Face generation (vLLM needs a GPU), one process, two steps of two prompts with short
# answers, console and JSONL logging (the scripts' wandb needs an account), no periodic validation or saves.
CPU_SUFFIX = ("model.path=tiny", "critic.path=null", "rollout.engine=hf", "devices.num_gpus_per_node=null",
              "trainer.total_steps=2", "data.train_batch_size=2", "rollout.n=2", "data.max_prompt_length=128",
              "rollout.max_new_tokens=16", "actor.mini_batch_size=2", "actor.micro_batch_size=2",
              "actor.max_tokens_per_micro_batch=null", "critic.mini_batch_size=2", "critic.micro_batch_size=2",
              "critic.max_tokens_per_micro_batch=null", "trainer.val_every=0", "trainer.val_before_train=false",
              "checkpoint.save_interval=0", "logging.backends=[console,jsonl]")


# The same for an SFT run (`trainer.kind=sft`): two optimizer steps of two rows, however many epochs.
CPU_SUFFIX_SFT = ("model.path=tiny", "devices.num_gpus_per_node=null", "sft.steps=2", "sft.epochs=null",
                  "sft.batch_size=2", "actor.micro_batch_size=2", "actor.max_tokens_per_micro_batch=null",
                  "data.max_prompt_length=128", "data.max_response_length=64", "trainer.val_every=0",
                  "checkpoint.save_interval=0", "logging.backends=[console,jsonl]")


def _one_process_cannot(translation: Translation) -> str | None:
    """The run's Ulysses size where it splits sequences over several processes, which the CPU line's one
    process cannot (None where it does not)."""
    size = next((item.partition("=")[2] for item in reversed(translation.ours)
                 if item.startswith("actor.sequence_parallel_size=")), None)
    return size if size is not None and _number(size) not in (None, 1.0) else None


def cpu_command(translation: Translation) -> str:
    """The translated command with `CPU_SUFFIX` (`CPU_SUFFIX_SFT` for an SFT run; and, where the run names
    no reward function, verl's data_source defaults as ours) in place of the run's own values, to try the
    run here before the real hardware."""
    suffix = list(CPU_SUFFIX_SFT if "trainer.kind=sft" in translation.ours else CPU_SUFFIX)
    if any(ours == _DEFAULT_REWARDS for _, ours in translation.decide):
        suffix.append(_DEFAULT_REWARDS.split("'")[1])
    if any(item.startswith("algorithm.overlong_buffer=") for item in translation.ours):
        suffix.append("algorithm.overlong_buffer=4")  # inside the 16 tokens above
    if any(item.startswith("reward.model_path=") for item in translation.ours):
        suffix.append("reward.model_path=tiny")  # the tiny model with a one-label score head
    if _one_process_cannot(translation):
        suffix.append("actor.sequence_parallel_size=1")  # one process holds whole sequences
    keys = {item.partition("=")[0] for item in suffix}
    cpu = Translation(ours=[i for i in translation.ours if i.partition("=")[0] not in keys] + suffix,
                      flags=["--nproc 1"])
    return cpu.command()


def report(module: str, translation: Translation) -> tuple[str, str]:
    """What a volcengine/verl entry point prints: (stdout, stderr). stdout is the same run as a `verl train`
    command line, then a `#` line with the same run sized for this CPU, so `$(python -m ...)` or a copy of
    either line runs it; stderr has the settings to decide, those with nothing here and the translated ones
    that behave differently. It starts nothing."""
    out = f"{translation.command()}\n# try it on this CPU: {cpu_command(translation)}\n"
    lines = [f"`python -m {module}` is volcengine/verl's entry point; this verl trains with `verl train` and its "
             "own keys (docs/migrating.md). Nothing was started; the same run here is on stdout."]
    if translation.decide:
        lines += ["", "Decide these (the meaning differs here):"]
        lines += [f"  {theirs}  ->  {ours}" for theirs, ours in translation.decide]
    if translation.notes:
        lines += ["", "Translated to the nearest setting here:"]
        lines += [f"  {theirs}  ->  {ours}" for theirs, ours in translation.notes]
    if translation.missing:
        lines += ["", "No equivalent here (left out):"] + [f"  {item}" for item in translation.missing]
    size = _one_process_cannot(translation)
    if size is not None:
        lines += ["", f"The CPU line runs actor.sequence_parallel_size=1 (the run's own line keeps {size}): its one "
                  f"process holds whole sequences, which a {size}-way split needs {size} processes for."]
    lines += ["", "`verl check` with the same arguments runs every start-up check without training."]
    return out, "\n".join(lines) + "\n"


__all__ = ["CPU_SUFFIX", "CPU_SUFFIX_SFT", "ENTRY_POINTS", "Translation", "translate_command", "cpu_command",
           "is_our_key", "report", "translate", "translate_sft"]
