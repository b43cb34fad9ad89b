"""What a run of a vision-language policy (images in its prompts) cannot combine with yet, refused before any
model loads, each with the key to change: every stage passes each row's pixels beside its tokens, and these
paths carry tokens only."""

from __future__ import annotations

from typing import Any

from verl.config.schema import RunConfig
from verl.distributed.mapping import DeviceMapping
from verl.errors import ConfigError, VerlError
from verl.models.vision import is_vision_language


def check_images(config: RunConfig, kind: str, hf_config: Any, mapping: DeviceMapping | None = None
                 ) -> list[VerlError]:
    """The settings a `kind` run ("rl", "sft", "dpo") of a vision-language policy (`hf_config`) refuses; [] for a
    text model."""
    if hf_config is None or not is_vision_language(hf_config):
        return []
    name = getattr(hf_config, "model_type", "vision-language")
    refused = [(config.actor.sequence_parallel_size > 1,
                "actor.sequence_parallel_size > 1 splits sequences over ranks", "actor.sequence_parallel_size=1")]
    if kind == "sft":
        refused.append((config.sft.packing, "sft.packing=true packs rows into one sequence", "sft.packing=false"))
    if kind == "rl":
        split_ref = (mapping is not None and "ref" in mapping.roles
                     and set(mapping.ranks("ref")) != set(mapping.ranks("actor")))
        refused += [
            (config.actor.remove_padding, "actor.remove_padding=true packs sequences into one row",
             "actor.remove_padding=false"),
            (config.actor.tensor_parallel_size > 1, "actor.tensor_parallel_size > 1 splits the head over the "
             "vocabulary", "actor.tensor_parallel_size=1"),
            (config.needs_teacher, "algorithm.distill's teacher scores text only", "drop algorithm.distill"),
            (config.is_async, "asynchronous rollouts send prompts to the sampler as tokens only",
             "synchronous rollouts (no devices.rollout)"),
            (split_ref, "the reference on ranks of its own would receive the tokens without the images",
             "--ref_device_id among the actor's devices"),
        ]
    return [ConfigError(f"{what}, which verl does not do yet for a vision-language policy ({name}). Fix: {fix}")
            for bad, what, fix in refused if bad]


__all__ = ["check_images"]
