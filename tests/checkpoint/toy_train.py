"""A tiny but complete training loop that uses every piece a real trainer checkpoints.

Model with dropout (torch RNG), AdamW, a LinearLR schedule, a seeded data order (sampler state), numpy and
python randomness in the step, metrics so far: if any of these is not restored, resumed weights differ.
Run as a script (``python toy_train.py RUN_DIR TOTAL SAVE_INTERVAL RESUME [async]``) for the SIGKILL tests;
it prints ``SAVING <step>`` before each save and ``DONE`` at the end.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__":  # run as a file: make `verl` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from verl.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state  # noqa: E402

N, D, B = 64, 16, 8


def make_app(seed: int = 0, width: int = 32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(D, width), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(width, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=50)
    gen = torch.Generator().manual_seed(seed + 1)
    data_gen = torch.Generator().manual_seed(1234)
    x = torch.randn(N, D, generator=data_gen)
    y = x.sum(dim=1, keepdim=True).sin()
    return model, opt, sched, gen, (x, y)


def train(
    run_dir: Path,
    total: int,
    *,
    save_interval: int = 1,
    resume: str = "never",
    async_save: bool = False,
    save_total_limit: int | None = None,
    seed: int = 0,
    announce: bool = False,
    width: int = 32,
):
    """Train to ``total`` steps; returns (model, metrics)."""
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    model, opt, sched, gen, (x, y) = make_app(seed, width)
    metrics: list[float] = []
    start = 0
    mgr = CheckpointManager(
        run_dir, save_interval=save_interval, save_total_limit=save_total_limit, async_save=async_save
    )
    app = {"model": model, "optimizer": opt}
    path = mgr.find_resume(resume)
    if path is not None:
        extra = mgr.load(path, app_state=app)
        sched.load_state_dict(extra["scheduler"])
        gen.set_state(extra["sampler"])
        restore_rng_state(extra["rng"])
        start = extra["trainer"]["step"]
        metrics = list(extra["trainer"]["metrics"])
    model.train()
    for step in range(start + 1, total + 1):
        idx = torch.randperm(N, generator=gen)[:B]
        noise = torch.from_numpy(np.random.randn(B, 1).astype(np.float32)) * 0.01
        scale = 1.0 + 0.01 * random.random()
        loss = ((model(x[idx]) - y[idx] - noise) ** 2).mean() * scale
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        metrics.append(loss.item())
        if mgr.should_save(step, step == total):
            if announce:
                print(f"SAVING {step}", flush=True)
            mgr.save(
                step,
                app_state=app,
                extra={
                    "scheduler": sched.state_dict(),
                    "sampler": gen.get_state(),
                    "rng": capture_rng_state(),
                    "trainer": {"step": step, "metrics": list(metrics)},
                    "config": "seed: 0\n",
                },
            )
    mgr.close()
    if announce:
        print("DONE", flush=True)
    return model, metrics


if __name__ == "__main__":
    run_dir, total, interval, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    async_save = len(sys.argv) > 5 and sys.argv[5] == "async"
    train(Path(run_dir), total, save_interval=interval, resume=resume, async_save=async_save, announce=True,
          width=256)
