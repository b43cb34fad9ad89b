"""Per-device memory estimate from parameter counts, dtypes, optimizer and sharding.

It is a lower bound on model state only (weights, gradients, optimizer moments); activations, the KV
cache and allocator fragmentation come on top. It exists so that an impossible placement (a 7B actor
with AdamW unsharded on one 24 GB card) is reported by `verl check` in a second instead of as an OOM
after the model loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from verl.distributed.mapping import DeviceMapping
from verl.errors import ConfigError, DeviceMappingError
from verl.utils.dtype import bytes_per_element

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
"""Tensors of optimizer state per parameter, each in the parameter's dtype (as torch.optim keeps them)."""

TRAINABLE_ROLES: tuple[str, ...] = ("actor", "critic")


@dataclass(frozen=True)
class MemoryEstimate:
    """bytes[rank][role] -> (params, grads, optimizer) in bytes, plus the table renderer and the limit check."""

    per_rank: dict[int, dict[str, tuple[int, int, int]]]
    device_type: str

    def total(self, rank: int) -> int:
        return sum(sum(parts) for parts in self.per_rank[rank].values())

    def peak(self) -> tuple[int, int]:
        """(rank, bytes) of the most loaded device."""
        rank = max(self.per_rank, key=self.total)
        return rank, self.total(rank)

    def render_table(self) -> str:
        """One row per rank, or per run of consecutive ranks holding the same (`0-127`): what each role costs
        there and the total, in GiB."""
        header = ("rank", "roles", "params", "grads", "optimizer", "total")
        runs: list[tuple[int, int, tuple[str, ...]]] = []
        for rank in sorted(self.per_rank):
            parts = self.per_rank[rank]
            p = sum(v[0] for v in parts.values())
            g = sum(v[1] for v in parts.values())
            o = sum(v[2] for v in parts.values())
            cells = (",".join(parts) or "-", _gib(p), _gib(g), _gib(o), _gib(p + g + o))
            if runs and runs[-1][2] == cells and runs[-1][1] == rank - 1:
                runs[-1] = (runs[-1][0], rank, cells)
            else:
                runs.append((rank, rank, cells))
        rows = [header, *((str(a) if a == b else f"{a}-{b}", *cells) for a, b, cells in runs)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            "  ".join(c.rjust(widths[i]) if i >= 2 else c.ljust(widths[i]) for i, c in enumerate(r))
            for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines) + "\n(model state only: activations and KV cache come on top)"

    def check(self, device_memory_bytes: int | None) -> list[str]:
        """Compare with the device's memory: an error on GPU (it would OOM), a warning string on CPU."""
        if device_memory_bytes is None:
            return []
        over = [r for r in sorted(self.per_rank) if self.total(r) > device_memory_bytes]
        if not over:
            return []
        worst = max(over, key=self.total)
        msg = (
            f"estimated model state on rank(s) {over} exceeds the device memory of {_gib(device_memory_bytes)} GiB "
            f"(rank {worst}: {_gib(self.total(worst))} GiB).\n{self.render_table()}\n"
            f"Fix: shard over more ranks (fsdp.sharding_strategy=FULL_SHARD, more processes), move roles to "
            f"other ranks (devices.*), use bfloat16, or enable fsdp.cpu_offload."
        )
        if self.device_type == "cuda":
            raise DeviceMappingError("Memory estimate: " + msg)
        return ["Memory estimate: " + msg]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _shard_factor(sharding: str, group_size: int, hybrid_shard_size: int | None) -> int:
    if sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return group_size
    if sharding == "HYBRID_SHARD":
        return min(group_size, hybrid_shard_size or group_size)
    if sharding == "NO_SHARD":
        return 1
    raise ConfigError(
        f"fsdp.sharding_strategy={sharding!r} is unknown. Fix: use FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD."
    )


def estimate_memory(
    param_counts: dict[str, int],
    dtypes: dict[str, str | None],
    *,
    mapping: DeviceMapping,
    optimizer: str = "adamw",
    sharding: str | dict[str, str] = "FULL_SHARD",
    hybrid_shard_size: int | None = None,
    trainable: Iterable[str] = TRAINABLE_ROLES,
    trainable_counts: dict[str, int] | None = None,
) -> MemoryEstimate:
    """Bytes of model state per device for the placement in `mapping` (group sizes come from there).

    Trainable roles (actor, critic) pay weights + gradients + optimizer moments; frozen ones (ref, reward)
    pay weights only. Sharded state is divided by the shard group; SHARD_GRAD_OP keeps the full weights
    gathered between forward and backward, so its peak counts the weights unsharded. A role missing from
    `param_counts` costs nothing (e.g. no reward model). Missing dtypes count as float32.
    `trainable_counts[role]` is how many of a trainable role's parameters train (LoRA: the adapters);
    gradients and optimizer moments are paid for those only (default: all of them).
    """
    opt_key = optimizer.lower()
    if opt_key not in OPTIMIZER_STATES:
        raise ConfigError(
            f"optimizer {optimizer!r} has no memory model. Fix: use one of {', '.join(OPTIMIZER_STATES)}."
        )
    trainable_set = set(trainable)
    per_rank: dict[int, dict[str, tuple[int, int, int]]] = {r: {} for r in range(mapping.world_size)}
    for role, ranks in mapping.roles.items():
        count = int(param_counts.get(role, 0))
        if count <= 0:
            continue
        width = bytes_per_element(dtypes.get(role) or "float32", where=f"{role} dtype")
        strategy = sharding.get(role, "FULL_SHARD") if isinstance(sharding, dict) else sharding
        shards = _shard_factor(strategy, len(ranks), hybrid_shard_size)
        sharded = -(-count * width // shards)  # ceil: uneven shards pad the last rank
        params = count * width if strategy == "SHARD_GRAD_OP" else sharded
        grads = opt = 0
        if role in trainable_set:
            trained = min(count, int((trainable_counts or {}).get(role, count)))
            grads = -(-trained * width // shards)
            opt = OPTIMIZER_STATES[opt_key] * grads
        for r in ranks:
            per_rank[r][role] = (params, grads, opt)
    return MemoryEstimate(per_rank=per_rank, device_type=mapping.device_type)


__all__ = ["MemoryEstimate", "estimate_memory", "OPTIMIZER_STATES"]
