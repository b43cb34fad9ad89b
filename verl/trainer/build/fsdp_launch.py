"""What `fsdp.*` does in this launch: one answer for `verl check` and for the trainer's process set-up.

Under torchrun (`verl train --nproc N`, N > 1, or torchrun itself) every process joins a group and FSDP2
shards the trained models. One process without torchrun (`verl train cfg`, `--nproc 1`) joins a 1-rank
group of its own whenever an option needs FSDP2 (mixed precision, CPU offload), so those options mean on
one device what they mean on eight instead of being dropped; activation checkpointing needs no FSDP and
is applied to the decoder layers directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from verl.config.schema import RunConfig
from verl.errors import ConfigError
from verl.trainer.build.precision import resolve_precision


@dataclass(frozen=True)
class FsdpLaunch:
    sharded: bool  # FSDP2 wraps the trained models (and the reference) on this launch
    own_group: bool  # one process without torchrun: it joins a 1-rank process group of its own to do so
    lines: list[str] = field(default_factory=list)  # what each option does here, for `verl check`
    offload: bool = False  # some role's FSDP2 CPU offload is on (its collectives then need a CPU backend too)


def under_torchrun() -> bool:
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def fsdp_launch(config: RunConfig, *, world_size: int, device_type: str, torchrun: bool | None = None,
                bf16_supported: bool | None = None) -> FsdpLaunch:
    """Whether this launch shards, and one line per `fsdp.*` option saying what it does here."""
    f = config.fsdp
    distributed = world_size > 1 or (under_torchrun() if torchrun is None else torchrun)
    try:
        precision = resolve_precision(config, device_type, bf16_supported=bf16_supported)
    except ConfigError:  # an unknown dtype spelling: reported by the dtype checks with its key
        precision = None
    offloading = {role: config.offloads(role) for role in ("actor", "critic")}
    any_offload = f.cpu_offload or any(offloading.values())
    offload = any_offload and device_type != "cpu"
    own_group = not distributed and ((precision is not None and precision.mixed is not None) or offload)
    sharded = distributed or own_group
    lines: list[str] = []
    if distributed:
        lines.append(f"fsdp in this launch: FSDP2 over the role's ranks ({world_size} process(es)), "
                     f"sharding_strategy={f.sharding_strategy}; the reference is sharded like the actor")
    elif own_group:
        lines.append("fsdp in this launch: one process without torchrun joins a 1-rank process group of its own "
                     "so FSDP2 applies the options below (nothing is split over one rank)")
    else:
        lines.append("fsdp in this launch: one process, no FSDP2 wrapping (no option below needs it)")
    if precision is not None:
        mp = f"fsdp.mixed_precision={_value(f.mixed_precision)}"
        lines.append(f"{mp}: {'applied' if precision.mixed is not None else 'off'}; {precision.describe()}")
    if f.activation_checkpointing:
        how = "by FSDP2's wrapping" if sharded else "directly (no FSDP2 needed)"
        lines.append(f"fsdp.activation_checkpointing=true: applied per decoder layer, {how}")
    if f.cpu_offload:
        lines.append("fsdp.cpu_offload=true: " + ("applied: sharded parameters, gradients and optimizer states live "
                                                  "on the CPU" if offload else "no effect on CPU"))
    for role, on in offloading.items():
        if getattr(config, role).cpu_offload is not None and on != f.cpu_offload:
            lines.append(f"{role}.cpu_offload={str(on).lower()}: " + (
                "no effect on CPU" if device_type == "cpu" else
                f"the {role}'s sharded parameters, gradients and optimizer states live on the "
                f"{'CPU' if on else 'GPU'}"))
        if getattr(config, role).activation_offload:
            lines.append(f"{role}.activation_offload=true: " + (
                "no effect on CPU (activations already live in host memory)" if device_type == "cpu" else
                "applied: the tensors its forward saves for backward wait in pinned host memory"))
    return FsdpLaunch(sharded=sharded, own_group=own_group, lines=lines, offload=any_offload)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value
    return "{" + ", ".join(f"{k}: {v}" for k, v in value.model_dump().items()) + "}"  # type: ignore[attr-defined]


__all__ = ["FsdpLaunch", "fsdp_launch", "under_torchrun"]
