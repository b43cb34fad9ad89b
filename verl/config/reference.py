"""Generate docs/config.md, the reference of every config key, from the typed schema.

    python -m verl.config.reference            # print the page
    python -m verl.config.reference --write    # write docs/config.md
    python -m verl.config.reference --check    # exit 1 when docs/config.md is stale

The schema (`verl.config.schema.RunConfig`) is the single source: each section is a table of its keys
(nested sections such as `model.lora` as dotted keys), their type with its bounds, the default and a
description. A key's description is, in this order: its `Field(description=...)`, a docstring under the
attribute, the entry in `NOTES` below (for keys whose schema line carries none), or a comment on the
attribute's line. A key added to the schema appears here the next time the generator runs.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from verl.config.schema import RunConfig

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m verl.config.reference --write"

# Descriptions of keys whose schema line has none (no `description=` or docstring), by dotted key or, for
# fields a section inherits, by `DeclaringClass.name`. The schema's own description wins, so adding one
# there replaces the entry here.
NOTES: dict[str, str] = {
    "model.trust_remote_code": "Run the model repository's own Python code (off unless you turn it on).",
    "model.revision": "Hub revision (branch, tag or commit) of model.path; None = the default branch.",
    "model.gradient_checkpointing": "Recompute activations in the backward to save memory (turns off the "
                                    "shared-prompt forward).",
    "data.train_files": "Training files (.jsonl, .json, .parquet, .csv, .arrow or a folder of them), or a Hugging "
                        "Face save_to_disk folder (a DatasetDict's split: FOLDER:SPLIT, default train); a "
                        "comma-separated string is accepted.",
    "data.val_files": "Held-out files, read like train_files (a DatasetDict folder gives its validation/test split).",
    "data.kind": "prompt (RL), sft (input/output or messages) or preference (DPO: prompt, chosen, rejected).",
    "data.max_prompt_length": "Prompt tokens at most (after the chat template); longer rows follow "
                              "data.truncation.",
    "data.truncation": "A row over a length limit: error (stop and report it), drop it, or cut the prompt "
                       "from the left.",
    "data.on_bad_row": "A malformed row: error stops before training with file:line, skip drops and counts it.",
    "data.shuffle": "Shuffle the training rows each epoch (seeded by trainer.seed; resumable).",
    "data.apply_chat_template": "auto = only to rows that are chat messages; always = to plain-text prompts too; "
                                "never = never (chat messages are then an error).",
    "env.kwargs": "Keyword arguments of the environment's constructor (an unknown one fails with a suggestion).",
    "rollout.engine": "hf = verl's own KV-cache sampler; vllm when vLLM is installed (GPU).",
    "rollout.max_new_tokens": "Response tokens at most (per turn in multi-turn environments).",
    "rollout.temperature": "Sampling temperature of training rollouts.",
    "rollout.top_p": "Nucleus sampling; 1.0 = off.",
    "algorithm.adv_estimator": "Advantage estimator (verl.algorithms.estimators): gae (PPO with a critic), "
                               "grpo, rloo, reinforce_pp, reinforce_pp_baseline.",
    "algorithm.gamma": "Discount factor (gae, reinforce_pp).",
    "algorithm.lam": "GAE lambda.",
    "algorithm.norm_by_std": "grpo: divide each advantage by the std of its scores (false: Dr. GRPO).",
    "algorithm.kl_in_reward": "Subtract kl_coef x KL to the reference from the token-level reward.",
    "algorithm.kl_coef": "KL coefficient in the reward (the adaptive controller's initial value).",
    "algorithm.kl_type": "KL estimator in the reward: k1, k2, k3 (clamped to [-10, 10]) or abs.",
    "algorithm.kl_ctrl": "fixed kl_coef, or adaptive (steers the per-token KL towards kl_target).",
    "algorithm.kl_horizon": "Adaptive controller's horizon: the coefficient moves by at most 20% of "
                            "batch size / kl_horizon per step.",
    "OptimConfig.lr": "Peak learning rate of AdamW.",
    "OptimConfig.weight_decay": "AdamW weight decay.",
    "OptimConfig.betas": "AdamW betas.",
    "OptimConfig.warmup_steps": "Linear learning-rate warm-up, in optimizer steps.",
    "OptimConfig.lr_schedule": "After the warm-up: constant, or cosine decay to min_lr_ratio x lr.",
    "OptimConfig.min_lr_ratio": "Floor of the cosine schedule, as a fraction of lr.",
    "OptimConfig.ppo_epochs": "Passes over each batch's mini-batches.",
    "OptimConfig.grad_clip": "Clip the gradient norm to this; None = off.",
    "OptimConfig.shuffle": "Shuffle mini-batches in each PPO epoch (whole groups when prompts are shared).",
    "OptimConfig.loss_agg": "How token losses become one loss: token-mean, seq-mean-token-mean, seq-mean-token-sum, "
                      "seq-mean-token-sum-norm (Dr. GRPO: each response's sum over rollout.max_new_tokens).",
    "actor.kl_loss_type": "KL estimator of the KL loss: k1, k2, k3 (clamped to [-10, 10]) or abs.",
    "actor.entropy_coef": "Entropy bonus coefficient; 0 = entropy only logged (from detached logits).",
    "critic.lr": "Peak learning rate of the critic's AdamW.",
    "critic.value_clip": "Clip range of the value loss around the old values; None = off.",
    "reward.functions": "Reward functions: built-ins (exact_match, numeric_match, math_verify, format, remote) "
                        "or path/to/file.py:fn / pkg.module:fn, each {name, kwargs, weight, batched, "
                        "data_sources}; a bare name is short for {name: ...}.",
    "reward.model_path": "A reward model (sequence classifier) whose score is added to the functions'.",
    "reward.model_dtype": "dtype of the reward model; None = model.dtype.",
    "reward.model_weight": "Weight of the reward model's score in the total reward.",
    "devices.critic": "Global ranks of the critic; None = every rank.",
    "devices.ref": "Global ranks of the reference model; None = every rank.",
    "devices.reward": "Global ranks of the reward model; None = every rank.",
    "devices.num_gpus_per_node": "GPUs per node, checked against the machine; None = detected.",
    "devices.allow_mixed_dtype": "Allow roles with different dtypes (refused by default).",
    "devices.timeout_s": "Timeout of every collective; the error names the stage and the ranks missing.",
    "fsdp.sharding_strategy": "FULL_SHARD (ZeRO-3: reshard after forward), SHARD_GRAD_OP (parameters stay "
                              "gathered from forward to backward), HYBRID_SHARD (shard within groups of "
                              "hybrid_shard_size ranks, replicate across), NO_SHARD (DDP-like).",
    "fsdp.mixed_precision": "auto (bfloat16 compute and float32 reductions over float32 master weights on a "
                            "GPU with bfloat16; off on CPU), false, true (bfloat16 compute, float32 "
                            "reductions) or {param_dtype, reduce_dtype}.",
    "fsdp.mixed_precision.param_dtype": "dtype of the gathered parameters in forward and backward.",
    "fsdp.mixed_precision.reduce_dtype": "dtype of the gradient reductions.",
    "fsdp.activation_checkpointing": "Recompute each layer's activations in the backward.",
    "fsdp.cpu_offload": "Keep sharded parameters and gradients on the CPU.",
    "fsdp.limit_all_gathers": "FSDP1 key, accepted; fully_shard bounds its all-gathers itself.",
    "fsdp.use_orig_params": "FSDP1 key; must stay true with LoRA (checked).",
    "fsdp.hybrid_shard_size": "HYBRID_SHARD: ranks per shard group; None = ranks per node.",
    "checkpoint.save_total_limit": "Keep at most this many checkpoints (oldest deleted; the checkpoint.keep_best "
                                   "one is kept apart, not counted); None = all.",
    "checkpoint.async_save": "Write checkpoints in the background; commit only after the write verifies.",
    "trainer.kind": "rl (PPO/GRPO/...), dpo or sft.",
    "trainer.total_steps": "Training steps (RL: batches of prompts; SFT/DPO: optimizer steps).",
    "trainer.seed": "Seeds python, numpy, torch and the samplers; a CPU run is reproducible bit for bit.",
    "trainer.val_before_train": "Validate once before the first step (the baseline).",
    "logging.backends": "console, jsonl, tensorboard, wandb, mlflow (the last three are optional installs).",
    "logging.project": "Project (wandb) / experiment (MLflow) name.",
    "logging.experiment": "Run name in the tracking backends; None = the run directory's name.",
    "dpo.beta": "DPO temperature beta.",
    "dpo.loss_type": "sigmoid (with label_smoothing), ipo or hinge.",
    "dpo.label_smoothing": "Conservative DPO: the probability that a preference label is flipped.",
    "dpo.precompute_ref": "Compute the reference log-probs once before training and free the reference.",
    "dpo.lr": "Learning rate of the DPO trainer.",
    "sft.packing": "Pack short examples into shared rows; position ids restart at every example, so examples never "
                   "attend to each other (each attends alone with verl's per-sequence attention where the model "
                   "allows, as actor.remove_padding does; else transformers' packed mask, probed at start-up).",
    "sft.lr": "Learning rate of the SFT trainer.",
    "sft.epochs": "Passes over the data (steps = epochs x batches per epoch); set sft.steps or sft.epochs, not both; "
                  "neither = trainer.total_steps.",
    "sft.batch_size": "Examples per optimizer step.",
}


def _class_of(model: type[BaseModel], name: str) -> type:
    """The class in the MRO whose body declares `name` (fields can be inherited, e.g. actor from OptimConfig)."""
    for klass in model.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return klass
    return model


@cache
def _source_notes(klass: type) -> dict[str, str]:
    """Attribute docstrings and same-line comments of a class body, by attribute name."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.setdefault(tok.start[0], tok.string.lstrip("#").strip())
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    notes: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            notes[node.target.id] = " ".join(after.value.value.split())
            continue
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            if line in comments:
                notes[node.target.id] = comments[line]
                break
    return notes


def describe(model: type[BaseModel], name: str, field: FieldInfo, key: str) -> str:
    if field.description:
        return " ".join(field.description.split())
    notes = _source_notes(_class_of(model, name))
    # A docstring under the attribute is documentation; a bare comment is weaker than a NOTES entry.
    source = notes.get(name, "")
    for note_key in (key, f"{_class_of(model, name).__name__}.{name}"):
        if note_key in NOTES:
            return NOTES[note_key]
    return source


def format_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(format_type(a) for a in args)
    if origin in (list, tuple, dict, set):
        inner = ", ".join("..." if a is Ellipsis else format_type(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


_BOUNDS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))


def format_bounds(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _yamlish(value: Any) -> str:
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def format_default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    text = _yamlish(value)
    return f"`{text}`" if text else ""


def _models_in(tp: Any) -> list[type[BaseModel]]:
    """Sections nested in a field's type: `LoraConfig`, or `MixedPrecisionSpec` inside `bool | Spec`."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _models_in(a)]


def rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        nested = _models_in(field.annotation)
        typ = format_type(field.annotation)
        bounds = format_bounds(field)
        if bounds:
            typ = f"{typ} ({bounds})"
        if not (nested and typ == "section"):
            out.append((key, typ, format_default(field), describe(model, name, field, key)))
        for sub in nested:
            out.extend(rows(sub, key))
    return out


def _cell(text: str) -> str:
    return text.replace("\n", " ").replace("|", "\\|").replace("\\\\|", "\\|")


def _section_doc(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__") or ""
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split())


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from verl/config/schema.py by `" + COMMAND + "`; do not edit by hand. -->",
        "",
        "Every key of `verl.config.RunConfig`, by section: its type (with bounds), default and meaning. YAML, "
        "`key=value` overrides (`verl train cfg.yaml actor.lr=1e-6`), the legacy flags and "
        "`RLTrainer.from_pretrained(**sections)` all set these keys; an unknown key is an error with a "
        "suggestion. `verl train CONFIG --print-config` prints a resolved config.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{name})" for name in RunConfig.model_fields) + ".",
    ]
    for name, field in RunConfig.model_fields.items():
        section = _models_in(field.annotation)[0]
        lines += ["", f"## {name}", ""]
        doc = _section_doc(section)
        if doc and section.__module__.startswith("verl."):
            lines += [doc, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, typ, default, text in rows(section, name):
            lines.append(f"| `{key}` | {typ} | {_cell(default)} | {_cell(text)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name} under docs/")
    group.add_argument("--check", action="store_true", help="exit 1 when docs/config.md differs")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}")
    elif args.check:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is stale; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
