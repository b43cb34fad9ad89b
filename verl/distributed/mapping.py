"""Roles (actor, critic, ref, reward, teacher, rollout) on device groups: validated before any model is loaded.

The failures this prevents are the ones users hit at step 0 after minutes of model loading: a rank id
outside the world, `num_gpus_per_node 8` on a 4-GPU box ("invalid device ordinal"), a role with no
device, a reward model silently cast to another dtype. Everything here is a pure function of the config
and a few facts about the machine, so `verl check` and the trainer's start-up share it and tests need
no processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl.algorithms.estimators import ESTIMATORS
from verl.errors import ConfigError, DeviceMappingError
from verl.utils.dtype import canonical_dtype_name, dtype_aliases

CRITIC_FREE = tuple(name for name, estimator in ESTIMATORS.items() if not estimator.needs_critic)

ROLES: tuple[str, ...] = ("actor", "critic", "ref", "reward", "teacher", "rollout")
"""Fixed role order: process groups are created and batches moved in this order on every rank."""


@dataclass(frozen=True)
class DeviceMapping:
    """A validated placement: which global ranks run each active role, and in which dtype."""

    world_size: int
    nodes: int
    roles: dict[str, tuple[int, ...]]
    dtypes: dict[str, str | None]
    casts: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    device_type: str = "cpu"

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world_size // max(1, self.nodes))

    def ranks(self, role: str) -> tuple[int, ...]:
        """Global ranks of `role`; a KeyError names the active roles to make typos obvious."""
        if role not in self.roles:
            raise KeyError(f"role {role!r} is not active in this mapping (active: {', '.join(self.roles)})")
        return self.roles[role]

    def roles_on(self, rank: int) -> list[str]:
        """Roles this rank takes part in, in the fixed role order."""
        return [role for role, ranks in self.roles.items() if rank in ranks]

    def is_colocated(self) -> bool:
        """True when every active role runs on every rank (the default placement)."""
        everyone = tuple(range(self.world_size))
        return all(ranks == everyone for ranks in self.roles.values())

    def device_label(self, rank: int) -> str:
        """`node1:cuda:3`-style label so a user can find the physical device of a rank."""
        node, local = divmod(rank, self.ranks_per_node)
        dev = f"{self.device_type}:{local}" if self.device_type == "cuda" else "cpu"
        return f"node{node}:{dev}" if self.nodes > 1 else dev

    def render_table(self) -> str:
        """The mapping as a plain-text table (role, ranks, devices, dtype) for errors and `verl check`."""
        return render_mapping_table(self.world_size, self.roles, self.dtypes, self.device_label)


def render_mapping_table(
    world_size: int,
    roles: Mapping[str, Any],
    dtypes: Mapping[str, str | None],
    device_label: Any = None,
) -> str:
    """Render role -> ranks/dtype; tolerant of invalid entries because it is also used in error messages."""
    header = ("role", "ranks", "devices", "dtype")
    rows = [header]
    for role, ranks in roles.items():
        if ranks is None:
            rank_text, dev_text = f"all ({world_size})", "all"
        elif len(ranks) == 0:
            rank_text, dev_text = "(none)", "-"
        else:
            rank_text = ",".join(str(r) for r in ranks)
            if device_label is None:
                dev_text = "-"
            else:
                dev_text = ",".join(
                    device_label(r) if isinstance(r, int) and 0 <= r < world_size else "?" for r in ranks
                )
        rows.append((role, rank_text, dev_text, str(dtypes.get(role) or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _get(devices: Any, name: str, default: Any = None) -> Any:
    """Read a field from the lead's pydantic `devices` section, a dict, or None (all defaults)."""
    if devices is None:
        return default
    if isinstance(devices, Mapping):
        return devices.get(name, default)
    return getattr(devices, name, default)


def _launch_fix(ranks: list[Any], nodes: int) -> str:
    """How to launch the world these ranks need: the `verl train --nproc` flag, per node."""
    valid = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r >= 0]
    if not valid:
        return "launch more processes (verl train --nproc N, or torchrun --nproc_per_node=N)"
    per_node = -(-(max(valid) + 1) // max(1, nodes))
    where = f" on each of {nodes} nodes" if nodes > 1 else ""
    return (f"launch {per_node} processes{where} (`verl train --nproc {per_node}`, or torchrun "
            f"--nproc_per_node={per_node})")


def validate_device_mapping(
    devices: Any,
    *,
    world_size: int,
    algorithm_needs_critic: bool,
    needs_ref: bool,
    needs_reward_model: bool,
    needs_teacher: bool = False,
    is_async: bool = False,
    role_dtypes: dict[str, str | None],
    visible_devices: int | None,
    cuda_visible_devices: str | None,
    nodes: int = 1,
) -> DeviceMapping:
    """Check the role placement against the launched world and the machine; collect every problem.

    `devices` is the `devices` config section (object or dict) with actor/critic/ref/reward/teacher rank lists
    (None = every rank), num_gpus_per_node, allow_mixed_dtype. `visible_devices` is the accelerator count
    on this node (None on CPU: no device limit). Raises one DeviceMappingError with the mapping table and
    a fix for each problem; returns the mapping otherwise.
    """
    problems: list[str] = []
    notes: list[str] = []
    active = {
        "actor": True,
        "critic": algorithm_needs_critic,
        "ref": needs_ref,
        "reward": needs_reward_model,
        "teacher": needs_teacher,
        "rollout": is_async,
    }
    requested = {role: _get(devices, role) for role in ROLES}
    cvd = cuda_visible_devices if cuda_visible_devices not in (None, "") else "unset"

    # --- the world itself -----------------------------------------------------------------------
    if world_size < 1:
        problems.append(f"world size is {world_size}. Fix: launch at least one process.")
    if nodes < 1:
        problems.append(f"nodes={nodes}. Fix: pass the number of nodes torchrun was started with (>= 1).")
    elif world_size >= 1 and world_size % nodes != 0:
        problems.append(
            f"world size {world_size} is not divisible by {nodes} nodes. Fix: start the same number of "
            f"processes on every node (torchrun --nproc_per_node)."
        )
    per_node = world_size // nodes if nodes >= 1 and world_size >= 1 else world_size
    if visible_devices is not None and per_node > visible_devices:
        problems.append(
            f"{per_node} processes per node but only {visible_devices} visible devices "
            f"(CUDA_VISIBLE_DEVICES={cvd}); ranks {visible_devices}..{per_node - 1} of each node would fail with "
            f"'invalid device ordinal'. Fix: torchrun --nproc_per_node={visible_devices}, or make more devices "
            f"visible."
        )
    gpn = _get(devices, "num_gpus_per_node")
    if gpn is not None:
        if visible_devices is not None and gpn != visible_devices:
            problems.append(
                f"devices.num_gpus_per_node={gpn} but this node has {visible_devices} visible devices "
                f"(CUDA_VISIBLE_DEVICES={cvd}). Fix: set devices.num_gpus_per_node={visible_devices} or remove it "
                f"(it is detected)."
            )
        elif gpn * nodes != world_size:
            problems.append(
                f"devices.num_gpus_per_node={gpn} x {nodes} node(s) = {gpn * nodes} ranks, but {world_size} "
                f"processes were launched. Fix: set devices.num_gpus_per_node={per_node} or launch "
                f"`verl train --nproc {gpn}` (or torchrun --nproc_per_node={gpn})."
            )

    # --- each role's rank list ------------------------------------------------------------------
    resolved: dict[str, tuple[int, ...]] = {}
    for role in ROLES:
        ranks = requested[role]
        if not active[role]:
            if ranks is not None:
                notes.append(f"devices.{role}={list(ranks)} is ignored: this run has no {role} model.")
            continue
        if ranks is None:
            resolved[role] = tuple(range(max(world_size, 0)))
            continue
        ranks = list(ranks)
        if not ranks:
            if role == "critic":
                problems.append(
                    "devices.critic is empty, but the advantage estimator (gae) needs a critic. Fix: give the "
                    "critic ranks (e.g. devices.critic=[0]) or leave it unset to colocate it on every rank, "
                    f"or use a critic-free estimator ({', '.join(CRITIC_FREE)})."
                )
            else:
                problems.append(
                    f"devices.{role} is empty: the {role} role has no device. Fix: list its ranks "
                    f"(e.g. devices.{role}=[0]) or leave it unset to run it on every rank."
                )
            continue
        bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size]
        if bad:
            problems.append(
                f"devices.{role} has rank(s) {bad} outside the world of {world_size} process(es) (valid: 0.."
                f"{world_size - 1}). Fix: {_launch_fix(ranks, nodes)}, or use ranks below {world_size}."
            )
        dupes = sorted({r for r in ranks if ranks.count(r) > 1}, key=str)
        if dupes:
            problems.append(f"devices.{role} lists rank(s) {dupes} more than once. Fix: list each rank once.")
        if not bad and not dupes:
            resolved[role] = tuple(sorted(ranks))

    # --- asynchronous rollout: its ranks only generate --------------------------------------------
    if "rollout" in resolved:
        rollout = set(resolved["rollout"])
        for role, ranks in resolved.items():
            shared = sorted(rollout & set(ranks)) if role != "rollout" else []
            if shared:
                rest = [r for r in range(world_size) if r not in rollout]
                problems.append(
                    f"devices.rollout={sorted(rollout)} overlaps devices.{role}={list(ranks)} on rank(s) {shared}: "
                    f"rollout ranks generate while the trainer ranks train, so a rank cannot be both. Fix: give "
                    f"{role} other ranks (e.g. devices.{role}={rest or [0]}), or remove devices.rollout to "
                    "generate on the actor's ranks.")

    # --- dtypes ---------------------------------------------------------------------------------
    dtypes: dict[str, str | None] = {}
    unknown_dtype: set[str] = set()
    for role in ROLES:
        if not active[role]:
            continue
        name = role_dtypes.get(role)
        if name is None:
            dtypes[role] = None
            continue
        key = "reward.model_dtype" if role == "reward" else "model.dtype"
        try:
            dtypes[role] = canonical_dtype_name(name, where=key)
        except ConfigError:
            dtypes[role] = str(name)
            unknown_dtype.add(role)
            problems.append(
                f"{role} dtype {name!r} ({key}) is not a dtype verl knows. Fix: use float32, bfloat16 or "
                f"float16 (accepted spellings: {', '.join(dtype_aliases())})."
            )
    for role in role_dtypes:
        if role not in ROLES:
            problems.append(f"role_dtypes has unknown role {role!r}. Fix: use one of {', '.join(ROLES)}.")
    casts: list[str] = []
    known = {r: d for r, d in dtypes.items() if d is not None and r not in unknown_dtype}
    actor_dtype = known.get("actor")
    mismatched = {r: d for r, d in known.items() if actor_dtype is not None and d != actor_dtype}
    if mismatched:
        if _get(devices, "allow_mixed_dtype", False):
            for role, dt in mismatched.items():
                casts.append(
                    f"{role} runs in {dt} while the actor runs in {actor_dtype}: its outputs are cast to "
                    f"float32 explicitly before they meet the actor's (allowed by devices.allow_mixed_dtype)."
                )
        else:
            listed = ", ".join(f"{r}={d}" for r, d in mismatched.items())
            problems.append(
                f"dtype mismatch: actor={actor_dtype} but {listed}. A silent cast would change results and can "
                f"double memory. Fix: use the same dtype for every role (model.dtype / reward.model_dtype), or "
                f"set devices.allow_mixed_dtype=true to cast explicitly."
            )

    # --- idle ranks are legal but almost always a mistake worth saying out loud -----------------
    if not problems and world_size >= 1:
        used = set().union(*resolved.values()) if resolved else set()
        idle = [r for r in range(world_size) if r not in used]
        if idle:
            notes.append(
                f"rank(s) {idle} run no role: their devices stay idle. Give them a role or launch fewer processes."
            )

    device_type = "cuda" if visible_devices is not None else "cpu"
    if problems:
        table_roles = {role: requested[role] for role in ROLES if active[role]}
        table = render_mapping_table(world_size, table_roles, dtypes)
        raise DeviceMappingError(
            f"Invalid device mapping ({len(problems)} problem(s); world size {world_size}, {nodes} node(s), "
            f"CUDA_VISIBLE_DEVICES={cvd}):\n{table}\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return DeviceMapping(
        world_size=world_size,
        nodes=nodes,
        roles=resolved,
        dtypes=dtypes,
        casts=tuple(casts),
        notes=tuple(notes),
        device_type=device_type,
    )


__all__ = ["ROLES", "DeviceMapping", "validate_device_mapping", "render_mapping_table"]
