"""Run under torchrun by tests/gpu/test_gpu_training.py.

`train CONFIG`: the RL trainer as `verl train` runs it (NCCL process group, FSDP2 over the ranks), and a
report of what the policy became: backend, FSDP, master-weight dtype, the dtype a decoder layer computes in,
how many layers recompute their activations (`fsdp_report.json`, rank 0). Every rank also writes
`probe_rank{R}.json`: the roles it holds, the devices of its parameters' local shards and optimizer states
after each step, its reference's device, and (`train CONFIG moved`) the share of the actor's weight
elements the run changed (full state before `fit` against after, compared exactly).
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


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight, unsharded, copied to the CPU (a collective over the model's mesh when it is sharded; on
    one rank the full tensor can be the parameter's own storage, hence the copy)."""
    from torch.distributed.fsdp import FSDPModule

    from verl.distributed.fsdp import full_state_dict

    state = full_state_dict(model, cpu_offload=False) if isinstance(model, FSDPModule) else model.state_dict()
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _moved_share(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The share of weight elements that differ (exactly) after the run."""
    changed = sum(int((after[k].to("cpu", torch.float32) != v.to("cpu", torch.float32)).sum())
                  for k, v in before.items())
    return changed / sum(v.numel() for v in before.values())


def _devices(tensors) -> list[str]:
    from torch.distributed.tensor import DTensor

    return sorted({(t.to_local() if isinstance(t, DTensor) else t).device.type for t in tensors})


def _optimizer_devices(optimizer) -> list[str]:
    return _devices(v for state in optimizer.state.values() for k, v in state.items()
                    if torch.is_tensor(v) and k != "step")


def train(config_path: str, *flags: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from verl.config import load_config
    from verl.distributed.fsdp import find_decoder_layers
    from verl.distributed.process import shutdown_distributed
    from verl.trainer.rl_trainer import RLTrainer

    try:
        trainer = RLTrainer(load_config(config_path))
        policy = trainer.model  # None on a rank of a split placement that holds no actor
        before = _full_state(policy) if policy is not None and "moved" in flags else None
        steps: list[dict] = []
        step = trainer.step

        def probed_step():  # where the actor's shards and optimizer states live between steps
            metrics = step()
            if policy is not None:
                steps.append({"params": _devices(policy.parameters()),
                              "optimizer": _optimizer_devices(trainer.optimizer)})
            return metrics

        trainer.step = probed_step
        seen: list[str] = []
        hook = None
        if policy is not None:
            hook = find_decoder_layers(policy)[0].register_forward_hook(
                lambda mod, args, out: seen.append(str((out[0] if isinstance(out, tuple) else out).dtype))
                if torch.is_grad_enabled() else None)
        trainer.fit()
        if hook is not None:
            hook.remove()
        ref = trainer.ref_model
        probe = {
            "rank": trainer.rank, "roles": sorted(trainer.roles), "holds_actor": policy is not None,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "cuda_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
            "ref_devices": _devices(ref.parameters()) if ref is not None else None,
            "steps": steps,
            "moved_share": _moved_share(before, _full_state(policy)) if before is not None else None,
        }
        Path(config_path).with_name(f"probe_rank{trainer.rank}.json").write_text(json.dumps(probe))
        if policy is None:
            return
        layers = find_decoder_layers(policy)
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
    {"train": train, "guard": guard}[sys.argv[1]](*sys.argv[2:])
