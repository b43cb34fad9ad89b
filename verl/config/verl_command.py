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

from verl.config.loader import parse_value
from verl.config.schema import RunConfig
from verl.config.verl_compat import VERL_KEYS, VERL_SFT_KEYS

_PLAIN_KEY = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")
_ARR = "actor_rollout_ref"
# main_ppo keys whose setting is another key here (data.max_response_length is ours too, for SFT/DPO data)
_RENAMED = {"data.max_response_length": "rollout.max_new_tokens", "data.prompt_key": "data.fields.prompt"}
# verl keys whose values map onto one of ours: (our key, their value -> ours, what to decide for other values)
_VALUES: dict[str, tuple[str, dict[str, str], str]] = {
    "data.truncation": ("data.truncation", {"error": "error", "left": "truncate_left"},
                        "data.truncation (error, drop or truncate_left)"),
    f"{_ARR}.rollout.name": ("rollout.engine", {"hf": "hf", "vllm": "vllm"}, "rollout.engine (hf or vllm)"),
    f"{_ARR}.actor.policy_loss.loss_mode": ("actor.importance_sampling", {"vanilla": "token", "gspo": "sequence"},
                                            "actor.importance_sampling (token, or sequence for GSPO)"),
}
_REWARD_PATH, _REWARD_NAME = "custom_reward_function.path", "custom_reward_function.name"
_DEFAULT_REWARDS = ("name the functions, routed by data_sources, e.g. 'reward.functions=[{name: numeric_match, "
                    "data_sources: [openai/gsm8k]}, {name: math_verify, data_sources: [lighteval/MATH]}]'")
_USE_KL, _KL_COEF = f"{_ARR}.actor.use_kl_loss", f"{_ARR}.actor.kl_loss_coef"
_OVERLONG, _OVERLONG_LEN = "reward_model.overlong_buffer.enable", "reward_model.overlong_buffer.len"
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
    item, our key and what differs); `missing`: items with no equivalent here."""

    ours: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    decide: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

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
        key = key.strip()
        if not eq or not key or item.startswith("~"):
            out.missing.append(item)
        elif key in combined or key in _LAUNCH:
            given[key] = value
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


def translate(items: Sequence[str]) -> Translation:
    """A `verl.trainer.main_ppo` command line's `key=value` items (Hydra's `+`/`++` prefixes allowed), sorted
    into ours, to decide, and missing."""
    out, given = _sort(items, VERL_KEYS, (_REWARD_PATH, _REWARD_NAME, _USE_KL, _KL_COEF, _OVERLONG, _OVERLONG_LEN,
                                          _FILTER_LONG), _RENAMED)
    if _REWARD_PATH in given:  # verl's default function name is compute_score
        name = given.get(_REWARD_NAME) or "compute_score"
        out.ours.append(f"reward.functions=[{{name: {given[_REWARD_PATH]}:{name}}}]")
    elif _REWARD_NAME in given:
        out.decide.append((f"{_REWARD_NAME}={given[_REWARD_NAME]}",
                           "reward.functions=[{name: FILE.py:FUNCTION}] (custom_reward_function.path names the file)"))
    if _true(given.get(_USE_KL, "false")):  # verl's KL loss is off unless use_kl_loss; its coefficient 0.001
        out.ours.append(f"actor.kl_loss_coef={given.get(_KL_COEF, '0.001')}")
    elif _KL_COEF in given:
        out.decide.append((f"{_KL_COEF}={given[_KL_COEF]}", "actor.kl_loss_coef (it does nothing in verl without "
                           "use_kl_loss=True; here a value > 0 turns the KL loss on)"))
    if _true(given.get(_OVERLONG, "false")) and _OVERLONG_LEN in given:  # DAPO's overlong reward shaping
        out.ours.append(f"algorithm.overlong_buffer={given[_OVERLONG_LEN]}")
    elif _OVERLONG in given or _OVERLONG_LEN in given:
        theirs = " ".join(f"{k}={given[k]}" for k in (_OVERLONG, _OVERLONG_LEN) if k in given)
        out.decide.append((theirs, "algorithm.overlong_buffer (the buffer's length; > 0 turns it on, and verl "
                                   "needs both enable=True and len)"))
    if _true(given.get(_FILTER_LONG, "false")):  # verl drops too-long prompts before any truncation: last, so it wins
        out.ours.append("data.truncation=drop")
    if not any(k in given for k in (_REWARD_PATH, _REWARD_NAME)) and not any(o.startswith("reward.") for o in out.ours):
        # verl's default scores each sample with a scorer chosen by its data_source; here the functions are named
        out.decide.append(("(no custom_reward_function: verl picks a scorer by data_source)", _DEFAULT_REWARDS))
    _launch(given, out)
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
    return out


def _launch(given: Mapping[str, str], out: Translation) -> None:
    """verl's GPUs per node and node count: our launch flags (one process per GPU, as verl starts)."""
    if _GPUS in given:
        out.ours.append(f"devices.num_gpus_per_node={given[_GPUS]}")
        if given[_GPUS].strip() != "1":
            out.flags.append(f"--nproc {given[_GPUS]}")
    if given.get(_NODES, "1").strip() != "1":
        out.flags.append(f"--nnodes {given[_NODES]}")


def report(module: str, translation: Translation) -> str:
    """What `python -m verl.trainer.<module>` prints: the same run as a `verl train` command line, the
    settings to decide and those with nothing here. It starts nothing."""
    lines = [f"error: `python -m verl.trainer.{module}` is volcengine/verl's entry point; this verl trains with "
             "`verl train` and its own keys (docs/migrating.md). Nothing was started.",
             "", "The same run here:", f"  {translation.command()}"]
    if translation.decide:
        lines += ["", "Decide these (the meaning differs here):"]
        lines += [f"  {theirs}  ->  {ours}" for theirs, ours in translation.decide]
    if translation.missing:
        lines += ["", "No equivalent here (left out):"] + [f"  {item}" for item in translation.missing]
    lines += ["", "`verl check` with the same arguments runs every start-up check without training."]
    return "\n".join(lines) + "\n"


__all__ = ["Translation", "is_our_key", "report", "translate", "translate_sft"]
