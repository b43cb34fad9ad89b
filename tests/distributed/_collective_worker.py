"""A 2-rank split placement (actor on [0, 1], critic on [1]) run under the collective device check
(run by test_collective_devices.py): align, a stage on the critic's rank, a sum and metric means."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from _dist_workers import setup
from collective_check import MARKER, check_collective_devices


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from verl.distributed import RoleGroups, validate_device_mapping
    from verl.distributed.placement import Placement

    setup(rank, world, port)
    mapping = validate_device_mapping({"actor": [0, 1], "critic": [1]}, world_size=world,
                                      algorithm_needs_critic=True, needs_ref=False, needs_reward_model=False,
                                      role_dtypes={"actor": "float32", "critic": "float32"},
                                      visible_devices=None, cuda_visible_devices=None)
    with check_collective_devices() as check:
        groups = RoleGroups.create(mapping, timeout_s=60, device=MARKER)
        placement = Placement.create(groups, rank=rank, world_size=world, device=MARKER,
                                     receive=lambda fields: SimpleNamespace(**fields))
        width = 3 + rank  # the two actor ranks sampled responses of different lengths
        batch = SimpleNamespace(responses=torch.ones(2, width, dtype=torch.long).to(MARKER),
                                rewards=torch.full((2,), float(rank)).to(MARKER))
        batch = placement.align(batch, {"responses": ("right", 0)})

        def compute_values(b):
            b.values = b.rewards * 10
            return b

        batch = placement.run("critic", compute_values, batch, send=("responses", "rewards"), back=("values",))
        total = placement.all_reduce_sum(batch.values.sum().reshape(1))
        metrics = placement.mean_over_owners({"critic/x": 1.0} if rank == 1 else {"actor/y": 2.0})
    record = {"violations": check.violations, "checked": check.checked, "width": batch.responses.shape[1],
              "total": total.item(), "metrics": metrics}
    (Path(out_dir) / f"collectives{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
