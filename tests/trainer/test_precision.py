"""Precision by construction: trained weights are float32 masters (bfloat16 compute on a GPU), because a
bfloat16 weight does not move under an lr-1e-6 AdamW step; bfloat16 masters are refused unless insisted on."""

import pytest
import torch

from verl.config import load_config
from verl.errors import ConfigError
from verl.trainer.build.fsdp_launch import fsdp_launch
from verl.trainer.build.precision import Precision, resolve_precision, role_dtype_names
from verl.trainer.checks.startup import check_startup


def _share_moved_by_one_adamw_step(master: torch.dtype, compute: torch.dtype) -> float:
    """One AdamW step at lr 1e-6 on weights like a trained LM's (std 0.02): the share of weights that change.
    The gradient comes from a forward in `compute` (as under FSDP2 mixed precision)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(256, 256, generator=g) * 0.02).to(master))
    x = torch.randn(32, 256, generator=g)
    loss = (x.to(compute) @ weight.to(compute)).float().square().mean()
    loss.backward()
    before = weight.detach().clone()
    torch.optim.AdamW([weight], lr=1e-6, weight_decay=0.0).step()
    return (weight.detach() != before).float().mean().item()


def test_a_bf16_weight_does_not_move_at_lr_1e6_but_a_float32_master_does():
    assert _share_moved_by_one_adamw_step(torch.bfloat16, torch.bfloat16) < 0.05  # rounded back: lost
    assert _share_moved_by_one_adamw_step(torch.float32, torch.bfloat16) > 0.99  # the fixed default


def test_auto_on_a_cuda_device_is_float32_masters_with_bfloat16_compute():
    config = load_config(overrides=["model.path=tiny"])
    cuda = resolve_precision(config, "cuda", bf16_supported=True)
    assert cuda == Precision(master=torch.float32, frozen=torch.bfloat16, mixed=(torch.bfloat16, torch.float32))
    assert cuda.compute == torch.bfloat16
    # the run applies it: one process on a GPU shards on a 1-rank group so the mixed-precision policy exists
    launch = fsdp_launch(config, world_size=1, device_type="cuda", torchrun=False, bf16_supported=True)
    assert launch.own_group and launch.sharded
    # what `verl check` and the memory estimate see: computes in bf16 everywhere, holds float32 masters
    computes, holds = (role_dtype_names(config, "cuda", held=held, bf16_supported=True) for held in (False, True))
    assert computes["actor"] == computes["ref"] == "bfloat16"
    assert holds == {"actor": "float32", "critic": "float32", "ref": "bfloat16", "reward": None, "teacher": None,
                     "rollout": None}  # no reward model, teacher or rollout ranks in this run
    # CPU keeps today's float32 throughout, and a GPU without bfloat16 computes in float32
    assert resolve_precision(config, "cpu") == Precision(torch.float32, torch.float32, None)
    assert resolve_precision(config, "cuda", bf16_supported=False) == Precision(torch.float32, torch.float32, None)
    assert not fsdp_launch(config, world_size=1, device_type="cpu", torchrun=False).sharded


def _problems(*overrides: str, kind: str = "rl") -> list[str]:
    config = load_config(overrides=["model.path=tiny", "trainer.device=cpu", *overrides])
    return [str(p) for p in check_startup(config, world_size=1, device_type="cpu", kind=kind).problems]


def test_bf16_master_weights_are_refused_without_the_opt_in():
    (msg,) = [p for p in _problems("model.dtype=bfloat16") if "master weights" in p]
    assert msg.startswith("model.dtype=bfloat16 would hold the actor's master weights and optimizer states in "
                          "bfloat16: it keeps 8 significant bits, so an update smaller than 1/256 of a weight "
                          "rounds away")
    assert "Fix: model.dtype=auto" in msg and "model.low_precision_master_weights=true" in msg
    ppo = [p for p in _problems("model.dtype=bf16", "algorithm.adv_estimator=gae") if "master weights" in p]
    assert len(ppo) == 1 and "actor and critic's master weights" in ppo[0]
    assert any("master weights" in p for p in _problems("model.dtype=bf16", kind="sft"))
    # insisting, or training only float32 LoRA adapters, is accepted
    assert not any("master weights" in p for p in _problems("model.dtype=bfloat16",
                                                            "model.low_precision_master_weights=true"))
    assert not any("master weights" in p for p in _problems("model.dtype=bfloat16", "model.lora.rank=4"))
    assert not any("master weights" in p for p in _problems())


def test_an_unknown_dtype_is_still_reported_once_with_its_key():
    with pytest.raises(ConfigError, match="model.dtype"):
        resolve_precision(load_config(overrides=["model.dtype=bf61"]), "cpu")
    problems = _problems("model.dtype=bf61")
    assert sum("bf61" in p for p in problems) == 1
