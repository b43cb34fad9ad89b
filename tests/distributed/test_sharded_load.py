"""Sharded start-up (`verl.models.sharded_load`): on 2 gloo ranks the policy, the reference (a copy of
its initial weights) and the critic (from the actor) are built on the meta device, sharded, and each rank
reads only its rows of the safetensors files; gathered, they equal bit for bit what the unsharded load gives
(a tied-embedding tiny model; with LoRA too), and each rank reads about half of the bytes."""

from pathlib import Path

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import pytest
import torch

pytestmark = pytest.mark.dist

SPEC = "tiny:qwen2:64:2"


def _process(config, rank: int, world: int):
    from verl.distributed import RoleGroups
    from verl.distributed.mapping import validate_device_mapping
    from verl.trainer.build.setup import ProcessSetup

    mapping = validate_device_mapping(config.devices, world_size=world, algorithm_needs_critic=True,
                                      needs_ref=True, needs_reward_model=False, role_dtypes={},
                                      needs_teacher=bool(config.algorithm.distill.teacher_path),
                                      visible_devices=None, cuda_visible_devices=None)
    groups = RoleGroups.create(mapping, timeout_s=60, fsdp=config.fsdp)
    return ProcessSetup(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                        dtype=torch.float32, roles=set(mapping.roles_on(rank)), split=False, dp_rank=rank,
                        dp_size=world, generator=torch.Generator(), shuffle_generator=torch.Generator(),
                        groups=groups, frozen_dtype=torch.bfloat16)


def _roles(config, process, path: str, *, defer: bool):
    """Policy, reference and critic as `compose_rl` builds them (the policy sharded last)."""
    from verl.trainer.build.models import load_policy_with_report
    from verl.trainer.compose.components import setup_critic, setup_reference, setup_teacher, shard

    torch.manual_seed(config.trainer.seed)  # setup_process seeds every rank alike before the policy loads
    policy, tokenizer, _ = load_policy_with_report(config, path, device=process.device, dtype=process.dtype,
                                                   defer=defer)
    reference = setup_reference(config, policy, tokenizer, process)
    critic = setup_critic(config, policy, process, path)
    policy = shard(policy, "actor", config, process)
    critic = shard(critic, "critic", config, process)
    teacher = setup_teacher(config, tokenizer, process) if config.algorithm.distill.teacher_path else None
    return policy, reference, critic, torch.get_rng_state(), teacher


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered whole (sharded) or as it is."""
    from verl.distributed.fsdp import full_state_dict
    from verl.models.lora import AdapterOff

    if isinstance(model, AdapterOff):
        return {}
    state = full_state_dict(model, cpu_offload=False)
    state.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    return {k: v.detach().clone() for k, v in state.items()}


def loading_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from verl.config import load_config
    from verl.models.sharded_load import bytes_read
    from verl.trainer.build.models import resolve_model_path
    from verl.trainer.compose.components import sharded_start

    W.setup(rank, world, port)
    path = resolve_model_path(SPEC)
    results = {}
    for name, extra in (("plain", []), ("lora", ["model.lora.rank=4", "critic.lora.rank=2"]),
                        ("paths", [f"ref.path={SPEC}", f"critic.path={SPEC}",
                                   f"algorithm.distill.teacher_path={SPEC}"])):
        config = load_config(overrides=["trainer.device=cpu", f"model.path={SPEC}", "actor.kl_loss_coef=0.01",
                                        "algorithm.adv_estimator=gae", *extra])
        process = _process(config, rank, world)
        assert sharded_start(config, process)
        before = bytes_read()
        sharded = _roles(config, process, path, defer=True)
        read = bytes_read() - before
        unsharded = _roles(config, process.__class__(**{**vars(process), "groups": None}), path, defer=False)
        results[name] = {"read": read, "rng": [sharded[3], unsharded[3]],
                         "local": sum(p.to_local().numel() for p in sharded[0].parameters()),
                         "states": [[_state(m) for m in (*run[:3], run[4]) if m is not None]
                                    for run in (sharded, unsharded)],
                         "classes": [[type(m).__name__.removeprefix("FSDP") for m in run[:3]]
                                     for run in (sharded, unsharded)],
                         "trainable": [[sorted(n for n, p in m.named_parameters() if p.requires_grad)
                                        for m in run[:3]] for run in (sharded, unsharded)]}
    torch.save(results, Path(out_dir) / f"load{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_start_equals_unsharded_load_and_reads_half_per_rank(tmp_path):
    from safetensors import safe_open

    from verl.trainer.build.models import resolve_model_path

    W.launch(loading_worker, 2, str(tmp_path))
    file = Path(resolve_model_path(SPEC)) / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        keys = list(f.keys())
        file_bytes = sum(f.get_tensor(k).numel() * 4 for k in keys)
    assert "lm_head.weight" not in keys  # tied: one tensor, read once
    ranks = [torch.load(tmp_path / f"load{r}.pt", weights_only=False) for r in range(2)]
    for name in ("plain", "lora", "paths"):
        for r, res in enumerate(ranks):
            run = res[name]
            sharded, unsharded = run["states"]
            assert run["classes"][0] == run["classes"][1], (name, run["classes"])
            assert run["trainable"][0] == run["trainable"][1], name
            torch.testing.assert_close(run["rng"][0], run["rng"][1], rtol=0, atol=0)  # same draws after set-up
            assert len(sharded) == (4 if name == "paths" else 3)
            for role, got, want in zip(("policy", "reference", "critic", "teacher"), sharded, unsharded, strict=False):
                assert got.keys() == want.keys(), (name, role, set(got) ^ set(want))
                for key, value in want.items():
                    assert got[key].dtype == value.dtype and torch.equal(got[key], value), (name, role, key)
            assert sum(v.abs().sum() for k, v in unsharded[0].items() if "lora_A" in k or k.startswith("buffer")) > 0
            # policy + reference + critic backbone (the file's tensors, three times), each read in halves
            roles = {"plain": 3, "lora": 2, "paths": 4}[name]  # with LoRA the reference is the policy, adapters off
            assert run["read"] <= roles * file_bytes / 2 + 4096, (name, r, run["read"], file_bytes)
            assert run["read"] >= roles * file_bytes / 2 - 4096 * 8, (name, r, run["read"], file_bytes)
    assert ranks[0]["plain"]["read"] + ranks[1]["plain"]["read"] == 3 * file_bytes
