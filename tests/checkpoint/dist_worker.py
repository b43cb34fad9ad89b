"""One rank of the 2-process gloo checkpoint test (run by test_dist.py, not collected by pytest)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from verl.checkpoint import CheckpointManager, capture_rng_state  # noqa: E402


def main() -> None:
    rank, world, init_file, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = CheckpointManager(run_dir, save_interval=1, save_total_limit=1, async_save=True, rank=rank,
                            world_size=world)
    for step in (1, 2):
        x = torch.ones(2, 4) * step
        model(x).sum().backward()
        for p in model.parameters():  # data parallel: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        torch.manual_seed(100 + rank)
        mgr.save(step, app_state={"model": model, "optimizer": opt},
                 extra={"rank": rank, "rng": capture_rng_state()})
    mgr.close()
    if rank == 0:
        torch.save(model.state_dict(), Path(run_dir) / "expected.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
