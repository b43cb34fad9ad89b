"""DAPO dynamic sampling on 2 gloo ranks: a rank short of varied groups makes every rank draw again (the
same number of rounds, so the prompt stream and FSDP's collectives stay in step), each rank ends with its
full share of varied groups, and group ids stay unique across ranks and rounds."""

from __future__ import annotations

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import _filter_groups_worker as F
import pytest
import torch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("filter_groups")
    W.launch(F.worker, 2, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_every_rank_gets_its_share_of_varied_groups_in_the_same_rounds(ranks):
    share = F.TRAIN_BATCH // 2 * F.N
    assert [r["dp"] for r in ranks] == [(0, 2), (1, 2)]
    assert not bool(ranks[0]["first_varied"].all())  # rank 0 was short after the first draw ...
    assert bool(ranks[1]["first_varied"].all())  # ... rank 1 was not, yet drew along with it
    rounds = [r["metrics"]["dynamic_sampling/rounds"] for r in ranks]
    assert rounds[0] == rounds[1] >= 1
    for r in ranks:
        assert len(r["group_ids"]) == share and bool(r["varied"].all())
        assert r["metrics"]["dynamic_sampling/filled_equal_frac"] == 0.0
        ids = r["group_ids"].tolist()
        assert all(ids[i] == ids[i - i % F.N] for i in range(len(ids)))  # whole groups
        assert torch.equal(r["scores"].double(), r["recomputed"].double())  # rows, responses, scores aligned
    assert torch.equal(ranks[1]["group_ids"], ranks[1]["first_ids"])  # rank 1 kept its first draw
    assert ranks[0]["metrics"]["dynamic_sampling/varied_group_frac"] < 1.0


def test_group_ids_are_unique_across_ranks_and_rounds(ranks):
    per_rank = F.TRAIN_BATCH // 2
    groups = [set(r["group_ids"].tolist()) for r in ranks]
    assert not groups[0] & groups[1]
    assert len(groups[0]) == len(groups[1]) == per_rank
    for rank, ids in enumerate(groups):  # each id names a prompt of this rank's slice of some round's draw
        assert all(rank * per_rank <= i % F.TRAIN_BATCH < (rank + 1) * per_rank for i in ids)
    assert max(groups[0]) >= F.TRAIN_BATCH  # rank 0 kept groups drawn in a later round
