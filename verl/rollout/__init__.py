"""Rollout engines: turn prompts into sampled responses with their logprobs.

``build_engine("hf", model)`` is our own KV-cache sampler and runs everywhere; ``build_engine("vllm",
model_path)`` uses vLLM when it is installed.
"""

from __future__ import annotations

from typing import Any

from verl.errors import ConfigError
from verl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from verl.rollout.hf_engine import HFKVCacheEngine
from verl.rollout.sampling import filtered_logprobs, sample_from_logprobs, sample_from_probs, sample_step
from verl.rollout.vllm_engine import VLLM_INSTALL_HINT, VLLMEngine
from verl.utils.suggest import did_you_mean

ENGINES = ("hf", "vllm")


def build_engine(name: str, model: Any, **kwargs: Any) -> RolloutEngine:
    """Make the rollout engine called ``name`` ("hf" or "vllm").

    For "hf", ``model`` is a loaded causal LM. For "vllm", it is the model's path or hub id (or a loaded
    model whose ``name_or_path`` points at its files), since vLLM loads its own copy of the weights.
    """
    if name == "hf":
        return HFKVCacheEngine(model, **kwargs)
    if name == "vllm":
        path = model if isinstance(model, str) else getattr(model, "name_or_path", None)
        if not path:
            raise ConfigError("rollout engine 'vllm' needs the model's path or hub id (vLLM loads its own "
                              f"weights); got a {type(model).__name__} without name_or_path. Pass the path.")
        if not isinstance(model, str):  # its config says whether it takes images, and which its image tokens are
            kwargs.setdefault("model_config", getattr(model, "config", None))
        return VLLMEngine(str(path), **kwargs)
    hint = did_you_mean(str(name), ENGINES)
    raise ConfigError(f"unknown rollout engine {name!r}; choose one of {', '.join(map(repr, ENGINES))}.{hint}")


__all__ = [
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "HFKVCacheEngine",
    "VLLMEngine",
    "VLLM_INSTALL_HINT",
    "build_engine",
    "filtered_logprobs",
    "sample_from_logprobs",
    "sample_from_probs",
    "sample_step",
    "ENGINES",
]
