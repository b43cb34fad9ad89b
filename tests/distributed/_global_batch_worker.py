"""Worker for test_global_batch.py: the advantage stage on 2 gloo ranks, each holding half the batch."""

from __future__ import annotations

from pathlib import Path

import torch
from _dist_workers import setup

from verl.algorithms import AdaptiveKLController
from verl.batch import RolloutBatch
from verl.config.schema import AlgorithmConfig
from verl.distributed import RoleGroups, validate_device_mapping
from verl.distributed.placement import Placement
from verl.trainer.rl.advantages import apply_kl_in_reward, estimate_advantages

N, R, KL_STEPS = 8, 6, 3


def make_batch(seed: int) -> RolloutBatch:
    """A float64 batch with ragged responses: rewards, values, old/ref log-probs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (N,), generator=g)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    mask[3] = 0  # an empty response
    return RolloutBatch(
        rows=[{} for _ in range(N)], group_ids=torch.arange(N) // 2,
        prompt_ids=torch.zeros((N, 2), dtype=torch.long), prompt_mask=torch.ones((N, 2), dtype=torch.long),
        response_ids=torch.zeros((N, R), dtype=torch.long), response_mask=mask,
        token_rewards=torch.randn(N, R, generator=g, dtype=torch.float64) * mask,
        values=torch.randn(N, R, generator=g, dtype=torch.float64),
        old_logprobs=-torch.rand(N, R, generator=g, dtype=torch.float64) * 3,
        ref_logprobs=-torch.rand(N, R, generator=g, dtype=torch.float64) * 3)


def half(batch: RolloutBatch, rank: int) -> RolloutBatch:
    return batch.select(torch.arange(rank * N // 2, (rank + 1) * N // 2))


ALGOS = {
    "gae": AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8),
    "reinforce_pp": AlgorithmConfig(adv_estimator="reinforce_pp", gamma=0.95),
    "reinforce_pp_baseline": AlgorithmConfig(adv_estimator="reinforce_pp_baseline"),
    "grpo_batch_std": AlgorithmConfig(adv_estimator="grpo", std_scope="batch"),
    "kl": AlgorithmConfig(adv_estimator="gae", kl_in_reward=True, kl_ctrl="adaptive", kl_coef=0.1,
                          kl_target=0.05, kl_horizon=10, kl_type="k3"),
}


WHITENED = ("gae", "reinforce_pp", "reinforce_pp_baseline", "grpo_batch_std")  # statistics of the global batch


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    setup(rank, world, port)
    mapping = validate_device_mapping(None, world_size=world, algorithm_needs_critic=False, needs_ref=False,
                                      needs_reward_model=False, role_dtypes={"actor": "float32"},
                                      visible_devices=None, cuda_visible_devices=None)
    placement = Placement.create(RoleGroups.create(mapping, timeout_s=60), rank=rank, world_size=world)
    reduce = lambda t: placement.all_reduce_sum(t, "actor")  # noqa: E731 - what the trainer passes
    out: dict[str, torch.Tensor] = {}
    for name in WHITENED:
        got = estimate_advantages(half(make_batch(0), rank), ALGOS[name], reduce)
        out[f"{name}/advantages"], out[f"{name}/returns"] = got.advantages, got.returns
    ctrl = AdaptiveKLController(0.1, 0.05, 10)
    betas = []
    for step in range(KL_STEPS):
        got = estimate_advantages(apply_kl_in_reward(half(make_batch(step + 1), rank), ALGOS["kl"], ctrl, reduce),
                                  ALGOS["kl"], reduce)
        betas.append(ctrl.value)
        out[f"kl/advantages{step}"] = got.advantages
    out["kl/betas"] = torch.tensor(betas, dtype=torch.float64)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
