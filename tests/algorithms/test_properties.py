"""Properties that must hold for any input, checked with hypothesis, plus the layering rule."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl.algorithms
from verl.algorithms import (
    aggregate_loss,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_returns,
    compute_rloo_advantages,
    masked_mean,
)

FAST = settings(max_examples=40, deadline=None)

# Integer-valued scores (as most verifiable rewards are): distinct scores stay distinct after shuffling
# or rescaling, so the properties hold to rounding instead of being amplified by 1 / eps.
int_scores_and_ids = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(-20, 20), min_size=n, max_size=n),
        st.lists(st.integers(-5, 5), min_size=n, max_size=n),
    )
)


@FAST
@given(int_scores_and_ids, st.randoms(use_true_random=False))
def test_group_advantages_are_permutation_equivariant_and_sum_to_zero(data, rnd):
    scores = torch.tensor(data[0], dtype=torch.float64)
    ids = torch.tensor(data[1])
    perm = list(range(len(scores)))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    for fn in (compute_grpo_advantages, compute_rloo_advantages):
        adv = fn(scores, ids)
        assert torch.allclose(fn(scores[p], ids[p]), adv[p], atol=1e-9)
        for g in ids.unique():
            assert abs(adv[ids == g].sum().item()) < 1e-8


@FAST
@given(int_scores_and_ids, st.floats(0.01, 100), st.floats(-50, 50))
def test_grpo_is_invariant_to_affine_rescaling_of_scores(data, scale, shift):
    scores = torch.tensor(data[0], dtype=torch.float64)
    ids = torch.tensor(data[1])
    a = compute_grpo_advantages(scores, ids, eps=0.0)
    b = compute_grpo_advantages(scores * scale + shift, ids, eps=0.0)
    assert torch.allclose(a, b, atol=1e-6)


masks = st.integers(1, 4).flatmap(
    lambda b: st.integers(1, 6).flatmap(
        lambda t: st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)
    )
)


@FAST
@given(masks, st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_gae_with_lam_one_is_return_to_go_minus_value(mask_rows, gamma, seed):
    mask = torch.tensor(mask_rows)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, gamma, 1.0)
    rtg = compute_reinforce_pp_returns(rewards, mask, gamma)
    assert torch.allclose(ret, rtg, atol=1e-9)
    assert torch.allclose(adv, torch.where(mask, rtg - values, 0), atol=1e-9)


@FAST
@given(masks, st.integers(0, 2**16))
def test_token_mean_aggregation_is_the_masked_mean(mask_rows, seed):
    mask = torch.tensor(mask_rows)
    x = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert torch.allclose(aggregate_loss(x, mask, "token-mean"), masked_mean(x, mask))
    # the seq modes agree when every present row has the same token count and norm_len equals it
    full = torch.ones_like(mask)
    t = mask.shape[1]
    a = aggregate_loss(x, full, "seq-mean-token-mean")
    assert torch.allclose(a, aggregate_loss(x, full, "seq-mean-token-sum-norm", norm_len=t))
    assert torch.allclose(a * t, aggregate_loss(x, full, "seq-mean-token-sum"))


def test_algorithms_import_only_torch_and_the_standard_library():
    pkg = Path(verl.algorithms.__file__).parent
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top == "torch" or top == "__future__" or top in sys.stdlib_module_names
                assert ok, f"{path.name} imports {name}; verl.algorithms may import only torch and the stdlib"
