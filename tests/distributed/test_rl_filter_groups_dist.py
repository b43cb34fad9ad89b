"""DAPO dynamic sampling on 2 gloo ranks: the actor ranks draw again (all of them, the same number of rounds,
so the prompt stream and FSDP's collectives stay in step) while the global batch is short of varied groups,
then the varied groups are dealt out over the ranks: no rank fills with equal-reward groups while another
throws varied ones away. Rows, responses and scores stay aligned, and group ids unique, across ranks and
rounds."""

from __future__ import annotations

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import _filter_groups_worker as F
import pytest
import torch

pytestmark = pytest.mark.dist

PER_RANK = F.TRAIN_BATCH // 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("filter_groups")
    W.launch(F.worker, 2, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_full_and_aligned(results):
    assert [r["dp"] for r in results] == [(0, 2), (1, 2)]
    rounds = [r["metrics"]["dynamic_sampling/rounds"] for r in results]
    assert rounds[0] == rounds[1] >= 1  # rank 0 was short after the first draw, rank 1 drew along with it
    for r in results:
        assert len(r["group_ids"]) == PER_RANK * F.N and bool(r["varied"].all())
        assert r["metrics"]["dynamic_sampling/filled_equal_frac"] == 0.0
        ids = r["group_ids"].tolist()
        assert all(ids[i] == ids[i - i % F.N] for i in range(len(ids)))  # whole groups
        assert torch.equal(r["scores"].double(), r["recomputed"].double())  # rows, responses, scores aligned
    groups = [set(r["group_ids"].tolist()) for r in results]
    assert not groups[0] & groups[1] and len(groups[0]) == len(groups[1]) == PER_RANK


@pytest.mark.parametrize("phase", ["half_equal", "all_equal"])
def test_every_rank_gets_its_share_of_varied_groups_in_the_same_rounds(ranks, phase):
    results = [r[phase] for r in ranks]
    assert not bool(results[0]["first_varied"].all())  # rank 0 was short after the first draw
    _assert_full_and_aligned(results)
    r1 = results[1]
    assert r1["metrics"]["dynamic_sampling/received_frac"] == 0.0
    first = r1["first_ids"][r1["first_varied"]]
    assert torch.equal(r1["group_ids"][: len(first)], first)  # rank 1 kept its first draw's varied groups
    for i in r1["group_ids"].tolist():  # rank 1's groups are its own
        assert PER_RANK <= i % F.TRAIN_BATCH < 2 * PER_RANK


def test_a_rank_without_varied_groups_gets_the_surplus_of_another(ranks):
    """Rank 0 draws only equal-reward groups; rank 1 draws more varied ones than its share. Rank 0 trains on
    rank 1's spare varied groups instead of filling with its own equal ones (which the update would skip),
    and rank 1 does not throw them away."""
    r0, r1 = ranks[0]["all_equal"], ranks[1]["all_equal"]
    assert not bool(r0["first_varied"].any())
    assert r0["metrics"]["dynamic_sampling/varied_group_frac"] == 0.0
    assert r0["metrics"]["dynamic_sampling/received_frac"] == 1.0
    assert all(PER_RANK <= i % F.TRAIN_BATCH < 2 * PER_RANK and i >= F.TRAIN_BATCH  # rank 1's later draws
               for i in r0["group_ids"].tolist())
    assert r1["metrics"]["dynamic_sampling/varied_group_frac"] > 0.5


def test_group_ids_name_prompts_of_some_ranks_draw(ranks):
    for rank, result in enumerate(ranks):
        for i in result["half_equal"]["group_ids"].tolist():
            origin = i % F.TRAIN_BATCH // PER_RANK
            assert origin == rank or (rank == 0 and origin == 1)  # rank 0 may hold rank 1's spare groups
