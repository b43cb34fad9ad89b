"""The sections of what a run trains and on what: the model with its LoRA adapters, the data, the environment."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from verl.config.section import MAX_THREADS, Section, _home, _split_csv


class LoraConfig(Section):
    """LoRA adapters (peft) on a model's linear layers; `rank: 0` trains every weight instead.

    With LoRA and no `ref.path`, the reference is the same model with its adapters switched off."""

    rank: int = Field(0, description="LoRA rank r; 0 = off (full fine-tune).")
    alpha: float | None = Field(None, description="LoRA scaling numerator (scale = alpha / rank); None = 2 x rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: str | list[str] = Field("all-linear", description="'all-linear' (every linear layer but the "
                                            "output head) or a list of module names, e.g. [q_proj, v_proj].")
    modules_to_save: list[str] | None = Field(None, description="Modules trained in full and saved with the "
                                              "adapter (e.g. [lm_head]).")
    _home = field_validator("path", mode="before")(_home)
    path: str | None = Field(None, description="An existing peft adapter folder to start from (its own rank, "
                                               "alpha and target modules apply).")

    _split = field_validator("modules_to_save", mode="before")(_split_csv)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() != "all-linear":
            return _split_csv(value)
        return value

    @property
    def enabled(self) -> bool:
        return self.rank != 0 or self.path is not None

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


class ModelConfig(Section):
    path: str = Field("tiny", description="HF model id or local dir; 'tiny' builds the local tiny model.")
    _home = field_validator("path", "tokenizer_path", mode="before")(_home)
    tokenizer_path: str | None = Field(None, description="Defaults to model.path (they must match).")
    chat_template: str | None = Field(None, description="Replace the tokenizer's chat template: 'hermes' (ChatML "
                                      "with the Hermes tool-call format, verl.data.tool_template.HERMES_TEMPLATE) or "
                                      "a path to a .jinja file. None = the tokenizer's own.")
    allow_tokenizer_mismatch: bool = Field(False, description="Accept a tokenizer_path whose vocabulary differs "
                                           "from model.path's own tokenizer (a warning instead of an error).")
    dtype: str = Field("auto", description="Dtype the weights are held in. auto = float32 master weights for "
                       "trained models (bfloat16 compute on GPUs with bfloat16, see fsdp.mixed_precision) and "
                       "bfloat16 frozen ones (reference, reward model) there; float32 on CPU. bfloat16/float16 "
                       "for a trained model needs model.low_precision_master_weights=true.")
    low_precision_master_weights: bool = Field(
        False, description="Train with model.dtype=bfloat16/float16 master weights and optimizer states anyway: "
        "an update smaller than the weight's rounding step (1/256 of it in bfloat16) is lost.")
    attn_implementation: str | None = Field(None, description="sdpa | eager | flash_attention_2; None = auto.")
    trust_remote_code: bool = False
    revision: str | None = None
    gradient_checkpointing: bool = False
    lora: LoraConfig = LoraConfig()


class MixtureSource(Section):
    """One source of `data.mixture`: files read like data.train_files, drawn with a relative weight."""

    name: str | None = Field(None, description="The source's name in metrics (reward/mean/<name>) and in each "
                             "row's `mixture` key; None = the first file's name without its extension.")
    files: list[str] = Field(default_factory=list, description="Files or folders, read like data.train_files "
                             "(each source has its own data report).")
    weight: float = Field(1.0, description="Relative share of each epoch's prompts (>= 0; the weights are "
                          "normalised, so 0.7/0.3 and 7/3 are the same mixture).")

    _split = field_validator("files", mode="before")(lambda v: _home(_split_csv(v)))

    @field_validator("weight")
    @classmethod
    def _weight(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"the weight is {v}; a mixture weight is a relative share, a number >= 0 (0 leaves the "
                             "source out)")
        return v

    @model_validator(mode="after")
    def _name(self) -> MixtureSource:
        if not self.files:
            raise ValueError("a mixture source needs files: [PATH, ...] (files or folders, read like "
                             "data.train_files)")
        if self.name is None:
            stem = os.path.basename(self.files[0].rstrip("/")).split(":")[0]
            self.__dict__["name"] = stem.split(".")[0] or stem
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ValueError(f"name={self.name!r}: a mixture source name is used in metric names; use letters, "
                             "digits, '_', '-' or '.'")
        return self


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list)
    val_files: list[str] = Field(default_factory=list)
    kind: Literal["prompt", "sft", "preference"] = "prompt"
    fields: dict[str, str] = Field(default_factory=dict, description="canonical field -> source key/path")
    train_batch_size: int = Field(8, gt=0, description="Prompts per step (RL) or examples per step.")
    val_batch_size: int = Field(64, gt=0, description="Held-out prompts answered at once in validation; with "
                                "several actor ranks each answers a contiguous share of the rows.")
    max_prompt_length: int = Field(512, gt=0)
    max_response_length: int = Field(512, gt=0, description="SFT/DPO response tokens.")
    truncation: Literal["error", "drop", "truncate_left"] = "error"
    on_bad_row: Literal["error", "skip"] = "error"
    shuffle: bool = True
    apply_chat_template: Literal["auto", "always", "never"] = "auto"
    val_size: int = Field(0, ge=0, description="Rows held out from train_files when val_files is empty.")
    mixture: list[MixtureSource] = Field(
        default_factory=list, description="Training prompts from several sources with weights, instead of "
        "train_files: [{name, files, weight}, ...]; each epoch holds every source's share of prompts exactly "
        "(seeded, resumable), and the step logs reward/mean/<name> per source.")

    _split = field_validator("train_files", "val_files", mode="before")(lambda v: _home(_split_csv(v)))

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        if not self.mixture:
            return self
        problems = []
        if self.train_files:
            problems.append(f"data.mixture and data.train_files ({', '.join(self.train_files)}) are both set; the "
                            "mixture is the training data. Move the files into a mixture source "
                            "({files: [...], weight: ...}) or remove data.mixture")
        if sum(m.weight for m in self.mixture) <= 0:
            problems.append(f"data.mixture weights sum to 0 ({', '.join(f'{m.name}: {m.weight}' for m in self.mixture)}"
                            "); give at least one source a weight > 0")
        names = [m.name for m in self.mixture]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            problems.append(f"data.mixture names {', '.join(twice)} more than one source; give each source its "
                            "own name")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class EnvConfig(Section):
    name: str | None = Field(None, description="Built-in environment (e.g. 'arithmetic') or your class as "
                                                "'path/to/file.py:Class' / 'pkg.module:Class'; None = data files.")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    agent: str | None = Field(None, description="Agent code as 'path/to/agent.py:function': an async function(row, "
                              "base_url) that calls the policy through an OpenAI-compatible endpoint and returns the "
                              "episode's reward (None: the environment's reward over the last reply). Needs "
                              "pip install -e '.[agent]' in this checkout (`verl` on PyPI is another project).")
    agent_timeout_s: float = Field(60.0, gt=0.0, description="An agent episode running longer ends with reward 0.")
    agent_call_budget: int = Field(32, gt=0, description="Calls an agent episode may make (every call with its key "
                                   "counts, a malformed one too); more are refused (429).")
    agent_max_body_bytes: int = Field(1 << 20, gt=0, description="The largest request body the agent endpoint reads; "
                                      "a larger one is refused (413) before it is read.")
    agent_concurrency: int = Field(64, gt=0, le=MAX_THREADS, description="Agent episodes running at once (at most "
                                   f"{MAX_THREADS}: each holds a thread). Their timing decides which calls share "
                                   "a batch, not what a call samples: each has random numbers of its own.")
    tool_call_format: str = Field("hermes", description="How the policy writes tool calls (hermes: Qwen2.5/Qwen3/"
                                  "Hermes <tool_call> tags, llama3_json: Llama 3.x): the endpoint returns them as "
                                  "OpenAI tool_calls.")
