"""What the start-up checks read off the policy's folder (no weights): its config, the attention facts, a
meta-device model for parameter counts and the memory plan's shape. `PolicyFacts` reads each once per check
pass, where the checks used to read the config up to five times and build the meta model up to three."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from verl.config.schema import RunConfig
from verl.distributed.sequence_parallel import model_facts
from verl.errors import VerlError
from verl.trainer.build.models import resolve_model_path
from verl.trainer.checks.lora_checks import meta_causal_lm, meta_model_of


class PolicyFacts:
    """The policy's facts for one check pass, each read on first use (None or {} where there is no local
    folder to read: the model check reports that)."""

    def __init__(self, config: RunConfig, model_path: str | None) -> None:
        self.config, self.model_path = config, model_path

    @cached_property
    def hf_config(self) -> Any:
        if self.model_path is None or not Path(self.model_path).expanduser().exists():
            return None
        try:
            return AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.config.model.trust_remote_code,
                                              revision=self.config.model.revision)
        except Exception:  # an unreadable model is reported by the model check itself
            return None

    @cached_property
    def text_config(self) -> Any:
        """The (text) config of a folder with a config.json, as `host_memory.text_config` reads it."""
        if self.hf_config is None or not (Path(self.model_path).expanduser() / "config.json").is_file():
            return None
        return getattr(self.hf_config, "get_text_config", lambda: self.hf_config)()

    @cached_property
    def attention(self) -> dict[str, Any]:
        """`model_facts` of the config (heads, sliding window, architecture); {} without one."""
        return model_facts(self.hf_config) if self.hf_config is not None else {}

    @cached_property
    def meta_model(self) -> torch.nn.Module | None:
        """The policy's model on the meta device (`lora_checks.meta_model_of`: a vision-language model with its
        vision tower), built once."""
        if self.hf_config is None:
            return None
        return meta_model_of(self.hf_config, trust_remote_code=self.config.model.trust_remote_code)


def count_parameters(path: str, *, trust_remote_code: bool = False, revision: str | None = None) -> int | None:
    """Parameters of a causal LM from its config alone (`meta_causal_lm`: no weights read, no memory used);
    None where it cannot be built here (the model check reports that)."""
    model = meta_causal_lm(path, trust_remote_code=trust_remote_code, revision=revision)
    return None if model is None else sum(p.numel() for p in model.parameters())

def teacher_parameters(config: RunConfig) -> int | None:
    """Parameters of the distillation teacher (from its config; None when it cannot be read here)."""
    try:
        path = resolve_model_path(config.algorithm.distill.teacher_path, key="algorithm.distill.teacher_path")
    except VerlError:
        return None
    return count_parameters(path, trust_remote_code=config.model.trust_remote_code)

def read_model_facts(config: RunConfig, model_path: str | None) -> dict[str, Any]:
    """The attention facts of a local model's config (`model_facts`; no weights); {} if there is none to read
    (another role's model: the policy's are read once by the pass's `PolicyFacts`)."""
    return PolicyFacts(config, model_path).attention
