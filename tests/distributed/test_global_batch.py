"""Statistics over "the batch" are over the global batch: 2 data-parallel ranks give what 1 rank gives on
the concatenated samples (whitened GAE / REINFORCE++ / REINFORCE++-baseline advantages, GRPO over the
batch's std, the adaptive KL coefficient)."""

from __future__ import annotations

import math

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import _global_batch_worker as G
import pytest
import torch

from verl.algorithms import AdaptiveKLController
from verl.trainer.rl.advantages import apply_kl_in_reward, estimate_advantages

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("global_batch")
    W.launch(G.worker, 2, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("name", G.WHITENED)
def test_whitened_advantages_of_two_ranks_equal_one_rank(ranks, name):
    whole = estimate_advantages(G.make_batch(0), G.ALGOS[name])
    got = torch.cat([r[f"{name}/advantages"] for r in ranks])
    assert got.dtype == torch.float64
    assert torch.allclose(got, whole.advantages, rtol=0, atol=1e-10)
    assert torch.allclose(torch.cat([r[f"{name}/returns"] for r in ranks]), whole.returns, rtol=0, atol=1e-10)
    # per-rank whitening (the old behaviour) gives different advantages: the test can tell them apart
    local = torch.cat([estimate_advantages(G.half(G.make_batch(0), r), G.ALGOS[name]).advantages for r in (0, 1)])
    assert (local - whole.advantages).abs().max() > 1e-3


def test_kl_coefficient_is_identical_on_both_ranks_and_equals_one_rank(ranks):
    betas = [r["kl/betas"] for r in ranks]
    assert torch.equal(betas[0], betas[1])
    ctrl = AdaptiveKLController(0.1, 0.05, 10)
    want = []
    for step in range(G.KL_STEPS):
        whole = estimate_advantages(apply_kl_in_reward(G.make_batch(step + 1), G.ALGOS["kl"], ctrl), G.ALGOS["kl"])
        want.append(ctrl.value)
        got = torch.cat([r[f"kl/advantages{step}"] for r in ranks])
        assert torch.allclose(got, whole.advantages, rtol=0, atol=1e-10)
    assert betas[0].tolist() == pytest.approx(want, rel=1e-12)
    assert len(set(want)) == G.KL_STEPS  # beta moved at every step


def test_kl_controller_input_is_the_mean_per_token_kl():
    batch = G.make_batch(1)
    ctrl = AdaptiveKLController(0.1, 0.05, 10)
    apply_kl_in_reward(batch, G.ALGOS["kl"], ctrl)
    fresh = G.make_batch(1)
    means = []
    for i in range(G.N):
        n = int(fresh.response_mask[i].sum())
        if n:
            x = [fresh.ref_logprobs[i, j].item() - fresh.old_logprobs[i, j].item() for j in range(n)]
            means.append(sum(min(math.exp(v) - v - 1, 10.0) for v in x) / n)
    want = sum(means) / len(means)
    assert batch.metrics["kl/in_reward"] == pytest.approx(want, rel=1e-12)
    error = min(max(want / 0.05 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + error * G.N / 10), rel=1e-12)  # n_steps = batch size
