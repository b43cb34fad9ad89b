"""update.policy_loss runs the loss that actor.policy_loss names, with the config's options and the truncated
importance weights passed through."""

import pytest
import torch

from verl.algorithms.policy_losses import POLICY_LOSSES, get_policy_loss
from verl.batch import RolloutBatch
from verl.config import load_config
from verl.trainer.rl import update

OPTIONS = {"ppo": ["actor.clip_high=0.05", "actor.dual_clip=1.5"],
           "gspo": ["actor.clip_low=0.05", "actor.clip_high=0.05"],
           "cispo": ["actor.clip_high=0.1"], "gmpo": ["actor.loss_options={clip_low: 0.1}"],
           "clip_cov": ["actor.loss_options={fraction: 0.2, cov_low: -9, cov_high: 9}"],
           "kl_cov": ["actor.loss_options={fraction: 0.3, kl_coef: 0.5}"]}


def micro_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    n, r = 4, 5
    mask = torch.ones(n, r)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    mb = RolloutBatch(rows=[{}] * n, group_ids=torch.arange(n), prompt_ids=torch.zeros(n, 1, dtype=torch.long),
                      prompt_mask=torch.ones(n, 1), response_ids=torch.zeros(n, r, dtype=torch.long),
                      response_mask=mask)
    mb.old_logprobs = -torch.rand(n, r, generator=g) * 2
    mb.rollout_logprobs = mb.old_logprobs + 0.3 * torch.randn(n, r, generator=g)
    mb.advantages = torch.tensor([[1.0], [0.5], [-0.7], [-1.2]]).expand(n, r).clone()
    logprobs = (mb.old_logprobs + 0.4 * torch.randn(n, r, generator=g)).requires_grad_(True)
    return mb, logprobs


def test_every_registered_loss_has_a_case_here():
    assert set(OPTIONS) == set(POLICY_LOSSES)


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("tis", [False, True])  # with the rollout correction's truncated importance weights
def test_policy_loss_runs_the_named_loss_with_its_options(name, tis):
    cfg = load_config(overrides=[f"actor.policy_loss={name}", *OPTIONS[name], "actor.loss_agg=seq-mean-token-mean",
                                 *(["actor.rollout_correction.mode=token_tis", "actor.rollout_correction.cap=1.5"]
                                   if tis else [])]).actor
    mb, logprobs = micro_batch()
    torch.manual_seed(3)
    loss, metrics = update.policy_loss(cfg, 5, lambda _: (logprobs, torch.zeros_like(logprobs)))(mb)
    corrected = update.correct_rollout(mb.old_logprobs, mb, update.explicit_plan(cfg.rollout_correction))
    weights = corrected.weights if tis else None
    torch.manual_seed(3)
    ref, stats = get_policy_loss(name)(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                       agg="seq-mean-token-mean", norm_len=5, token_weights=weights,
                                       **cfg.loss_kwargs())
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    assert metrics["actor/clipfrac"] == stats["clipfrac"]
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())  # no host sync
    defaults = get_policy_loss(name)(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                     agg="seq-mean-token-mean", norm_len=5, token_weights=weights,
                                     generator=torch.Generator().manual_seed(3))[0]
    if name != "clip_cov":  # the options matter (clip_cov's default fraction picks one token of 14 too)
        assert not torch.equal(loss, defaults)
