"""The reference is FSDP2-sharded over its ranks like the actor (at 7B an unsharded bf16 copy is 14 GiB on
every GPU): on 2 gloo ranks each holds half of it, and its log-probs are those of the unsharded copy."""

from pathlib import Path

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def reference_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from verl.config import load_config
    from verl.distributed import RoleGroups
    from verl.distributed.mapping import validate_device_mapping
    from verl.trainer.build.models import copy_in, frozen
    from verl.trainer.build.setup import ProcessSetup
    from verl.trainer.compose.components import setup_reference
    from verl.trainer.forward.logprobs import response_logprobs

    W.setup(rank, world, port)
    config = load_config(overrides=["trainer.device=cpu", "actor.kl_loss_coef=0.01"])
    mapping = validate_device_mapping(config.devices, world_size=world, algorithm_needs_critic=False,
                                      needs_ref=True, needs_reward_model=False, role_dtypes={},
                                      visible_devices=None, cuda_visible_devices=None)
    groups = RoleGroups.create(mapping, timeout_s=60, fsdp=config.fsdp)
    cpu = torch.device("cpu")
    process = ProcessSetup(rank=rank, world_size=world, local_rank=rank, device=cpu, dtype=torch.float32,
                           roles=set(mapping.roles_on(rank)), split=False, dp_rank=rank, dp_size=world,
                           generator=torch.Generator(), shuffle_generator=torch.Generator(), groups=groups,
                           frozen_dtype=torch.float32)
    policy = W.tiny_qwen2()
    unsharded = frozen(copy_in(policy, torch.float32))
    reference = setup_reference(config, policy, None, process)

    ids = W.global_batch()
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        got, _ = response_logprobs(reference, ids, mask, positions, 4)
        want, _ = response_logprobs(unsharded, ids, mask, positions, 4)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in reference.parameters())
    torch.save({"local": local, "total": sum(p.numel() for p in unsharded.parameters()), "got": got, "want": want,
                "trainable": [n for n, p in reference.named_parameters() if p.requires_grad],
                "training": reference.training}, Path(out_dir) / f"ref{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_reference_is_sharded_over_two_ranks_with_unchanged_logprobs(tmp_path):
    W.launch(reference_worker, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"ref{r}.pt", weights_only=False) for r in range(2)]
    total = results[0]["total"]
    for r, res in enumerate(results):
        assert abs(res["local"] - total / 2) <= 0.02 * total, (r, res["local"], total)  # about half each
        assert res["trainable"] == [] and res["training"] is False  # still frozen, in eval mode
        assert res["want"].abs().sum() > 0
        torch.testing.assert_close(res["got"], res["want"], rtol=1e-6, atol=1e-6)
    assert results[0]["local"] + results[1]["local"] >= total
