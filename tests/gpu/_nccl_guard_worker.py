"""Run under torchrun by tests/gpu/test_gpu_training.py.

`train CONFIG`: the RL trainer as `verl train` runs it (NCCL process group, FSDP2 over the ranks), and a
report of what the policy became: backend, FSDP, master-weight dtype, the dtype a decoder layer computes in,
how many layers recompute their activations.
`guard OUT_DIR`: two ranks on an NCCL process group; rank 1 never reaches the stage rank 0 waits at, so
rank 0's collective guard must time out with the stage and the missing rank.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def train(config_path: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from verl.config import load_config
    from verl.distributed.fsdp import find_decoder_layers
    from verl.distributed.process import shutdown_distributed
    from verl.trainer.rl_trainer import RLTrainer

    try:
        trainer = RLTrainer(load_config(config_path))
        layers = find_decoder_layers(trainer.model)
        seen: list[str] = []
        hook = layers[0].register_forward_hook(
            lambda mod, args, out: seen.append(str((out[0] if isinstance(out, tuple) else out).dtype))
            if torch.is_grad_enabled() else None)
        trainer.fit()
        hook.remove()
        report = {
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "fsdp": isinstance(trainer.model, FSDPModule),
            "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "compute_dtype": seen[0] if seen else None,
            "checkpointed_layers": sum(bool(getattr(layer, "_verl_checkpointed", False)) for layer in layers),
        }
        if trainer.rank == 0:
            (Path(config_path).parent / "fsdp_report.json").write_text(json.dumps(report))
    finally:
        shutdown_distributed()


def guard(out_dir: str) -> None:
    from verl.distributed.guard import CollectiveGuard
    from verl.errors import DistributedError

    torch.cuda.set_device(0)  # one GPU is enough: the guard talks through the store, not NCCL kernels
    dist.init_process_group("nccl")
    assert dist.get_backend() == "nccl"
    g = CollectiveGuard(timeout_s=3)
    if dist.get_rank() == 0:
        try:
            g.arrive("ref_logprobs", (0, 1))
        except DistributedError as err:
            Path(out_dir, "guard_timeout.txt").write_text(str(err))
    else:
        time.sleep(6)  # elsewhere, past rank 0's timeout
    dist.destroy_process_group()


if __name__ == "__main__":
    {"train": train, "guard": guard}[sys.argv[1]](sys.argv[2])
