"""What an actor rank holds at each moment of the start-up, while the models load and are sharded."""

from __future__ import annotations

from verl.distributed.memory_plan_types import CUDA_RUNTIME_BYTES, GIB, VLLM_ASLEEP_BYTES, PlanInputs

ROLE_NAMES = {"actor": "policy", "ref": "reference", "teacher": "teacher", "critic": "critic"}


def _offloaded(x: PlanInputs, role: str) -> bool:
    return role in x.offloaded or (x.cpu_offload and role not in x.kept)


def startup_moments(x: PlanInputs, device_bytes: int | None) -> list[tuple[str, list[tuple[str, int]]]]:
    """What an actor rank holds at each moment of the start-up that may be its peak, in the order the trainer
    builds its models (`verl.trainer.compose.components.compose_rl`): the reference and the teacher sharded first,
    then the actor, then a colocated vLLM starts (awake, its share of the device, then asleep), then the
    critic is sharded. No gradients and no optimizer moments yet: FSDP2 allocates gradients in the first
    backward and torch's AdamW its moments at the first `step()` (a resumed checkpoint loads them when the
    loop starts, which the rollout phase's plan covers).

    `x.reads_shards` (each role built on the meta device, FSDP2-sharded, then each rank reads only its rows
    of the safetensors files: `verl.models.sharded_load`): a role holds its shard in the dtype it is
    held in (the master dtype for trained roles, the compute dtype for frozen ones; none on the GPU where its
    `cpu_offload` puts the shards in host memory); the rows in flight pass through host memory, one tensor
    at a time, and are written into the shard. Otherwise each rank loads the policy whole on its device and
    makes whole copies of it (the reference, the critic; the teacher loads whole from its own path), each
    sharded in turn: the policy stays whole until every copy is made.
    A role sharded over one rank (one process, NO_SHARD) holds its whole model either way."""
    ctx = ("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES)
    load = {role: (whole, ranks) for role, whole, ranks in x.loading}
    held: dict[str, tuple[str, int]] = {}
    moments: list[tuple[str, list[tuple[str, int]]]] = []

    def shard(role: str) -> None:
        whole, ranks = load[role]
        name = ROLE_NAMES[role]
        if _offloaded(x, role):
            held[role] = (f"{name} weights: shards in host memory (cpu_offload)", 0)
        elif ranks > 1:
            held[role] = (f"{name} weights: this rank's shard (1/{ranks})", -(-whole // ranks))
        else:
            held[role] = (f"{name} weights: whole (not sharded over several ranks)", whole)

    def snap(moment: str) -> None:
        moments.append((moment, [*held.values(), ctx]))

    frozen = [role for role in ("ref", "teacher") if role in load]
    if x.reads_shards:
        for role in frozen:
            shard(role)
    elif "actor" in load:
        def whole(role: str, how: str) -> tuple[str, int]:
            later = "before sharding" if load[role][1] > 1 else "not sharded over several ranks"
            return (f"{ROLE_NAMES[role]} weights: {how} whole ({later})", load[role][0])

        held["actor"] = whole("actor", "loaded")
        for role in (*frozen, "critic"):
            if role in load:
                how = "loaded" if role == "teacher" else "copied from the policy"
                held[role] = whole(role, how)
                snap(f"{ROLE_NAMES[role]} {how} whole")
                if role != "critic":  # the critic is sharded after the actor (and after vLLM starts)
                    shard(role)
        if len(load) == 1:
            snap("policy loaded whole")
    if "actor" in load:
        shard("actor")
    if x.samples and x.engine == "vllm" and x.vllm_colocated and device_bytes is not None:
        budget = int(x.gpu_memory_utilization * device_bytes)
        held["vllm"] = (f"vLLM starting: gpu_memory_utilization {x.gpu_memory_utilization:g} x device", budget)
        snap("while vLLM starts")
        held["vllm"] = ("vLLM asleep (KV cache and weights released)", VLLM_ASLEEP_BYTES)
    if "critic" in load:
        shard("critic")
    snap("models loaded")
    return moments


def startup_notes(x: PlanInputs) -> list[str]:
    """How the start-up loads (each rank its shards, or whole copies first, and why)."""
    if not x.loading:
        return []
    whole = [ROLE_NAMES[r] for r, _, ranks in x.loading if ranks <= 1 and not _offloaded(x, r)]
    held_whole = f"; {', '.join(whole)} held whole on every rank (not sharded over several ranks)" if whole else ""
    if x.reads_shards:
        largest = max(x.shape.embed_params, x.shape.head_params, x.shape.intermediate * x.shape.hidden)
        ranks = max((n for _, _, n in x.loading), default=1)
        return [f"start-up: each role is built on the meta device and each rank reads only its shards from the "
                f"safetensors files (one tensor's rows at a time through host memory: at most "
                f"{largest * x.master_bytes / max(ranks, 1) / GIB:.2f} GiB here); gradients and optimizer "
                f"moments are allocated at the first step{held_whole}"]
    return [f"start-up: because of {x.whole_reason or 'a whole load'}, each actor rank loads the policy whole on "
            f"its GPU and copies it whole (reference, critic) before sharding{held_whole}"]


def sharded_startup_peak(x: PlanInputs, ranks: int | None, device_bytes: int | None) -> int:
    """The start-up peak if each rank read only its own shards: each role's 1/`ranks` (None: over the ranks
    it is sharded over in `x`)."""
    y = x.with_(reads_shards=True, loading=tuple((r, whole, ranks or n) for r, whole, n in x.loading))
    return max(sum(b for _, b in parts) for _, parts in startup_moments(y, device_bytes))
