"""A volcengine/verl command line (`python -m verl.trainer.main_ppo key=value ...`) read as ours.

Each `key=value` is sorted into one of three kinds, and none is applied silently:
  * the same setting here: our key with the user's value (`actor_rollout_ref.actor.optim.lr` -> `actor.lr`,
    our own keys kept as they are, `custom_reward_function.path/name` -> one `reward.functions` entry,
    `data.max_response_length` -> `rollout.max_new_tokens`, which is what verl means by it, `use_kl_loss` and
    `kl_loss_coef` -> `actor.kl_loss_coef`, `trainer.n_gpus_per_node` -> `--nproc`);
  * a setting whose meaning differs (a count, a unit, an on/off switch that is a value here): named with
    ours and what to decide (`VERL_KEYS`' notes);
  * a key with nothing here (vLLM memory fractions, Ray, Megatron): listed.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from verl.config.schema import RunConfig
from verl.config.verl_compat import VERL_KEYS

_PLAIN_KEY = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")
_ARR = "actor_rollout_ref"
# verl keys whose setting is another key here (data.max_response_length is ours too, for SFT/DPO data)
_RENAMED = {"data.max_response_length": "rollout.max_new_tokens", "data.prompt_key": "data.fields.prompt"}
_TRUNCATION = {"error": "error", "left": "truncate_left"}  # verl's data.truncation values that exist here
_ENGINES = ("hf", "vllm")
_REWARD_PATH, _REWARD_NAME = "custom_reward_function.path", "custom_reward_function.name"
_USE_KL, _KL_COEF = f"{_ARR}.actor.use_kl_loss", f"{_ARR}.actor.kl_loss_coef"
_GPUS, _NODES = "trainer.n_gpus_per_node", "trainer.nnodes"
_COMBINED = (_REWARD_PATH, _REWARD_NAME, _USE_KL, _KL_COEF, _GPUS, _NODES)


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


def translate(items: Sequence[str]) -> Translation:
    """Sort a verl command line's `key=value` items (Hydra's `+`/`++` prefixes allowed) into ours, to decide,
    and missing."""
    out = Translation()
    given: dict[str, str] = {}
    for item in items:
        key, eq, value = item.lstrip("+").partition("=")
        key = key.strip()
        if not eq or not key or item.startswith("~"):
            out.missing.append(item)
        elif key in _COMBINED:
            given[key] = value
        elif key in _RENAMED:
            out.ours.append(f"{_RENAMED[key]}={value}")
        elif key == "data.truncation" and value in _TRUNCATION:
            out.ours.append(f"data.truncation={_TRUNCATION[value]}")
        elif key == "data.truncation":
            out.decide.append((item, "data.truncation (error, drop or truncate_left)"))
        elif key == f"{_ARR}.rollout.name" and value in _ENGINES:
            out.ours.append(f"rollout.engine={value}")
        elif key in VERL_KEYS:
            ours = VERL_KEYS[key]
            if _PLAIN_KEY.match(ours) and is_our_key(ours):
                out.ours.append(f"{ours}={value}")
            else:
                out.decide.append((item, ours))
        elif is_our_key(key):
            out.ours.append(f"{key}={value}")
        else:
            out.missing.append(item)
    _combine(given, out)
    return out


def _combine(given: dict[str, str], out: Translation) -> None:
    """The verl settings that are two keys there and one here (or a launch flag)."""
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
    if _GPUS in given:
        out.ours.append(f"devices.num_gpus_per_node={given[_GPUS]}")
        if given[_GPUS].strip() != "1":  # one process per GPU, as verl's launcher starts
            out.flags.append(f"--nproc {given[_GPUS]}")
    if given.get(_NODES, "1").strip() != "1":
        out.flags.append(f"--nnodes {given[_NODES]}")


__all__ = ["Translation", "is_our_key", "translate"]
