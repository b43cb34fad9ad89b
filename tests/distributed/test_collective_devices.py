"""Every collective of a split placement gets its tensors on the role's device (what NCCL needs), checked
on CPU/gloo with the marker device of tests/distributed/collective_check.py."""

import json

import pytest
from _collective_worker import worker
from _dist_workers import launch

pytestmark = pytest.mark.dist


def test_split_placement_collectives_use_the_roles_device(tmp_path):
    launch(worker, 2, str(tmp_path))
    records = [json.loads((tmp_path / f"collectives{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        assert record["checked"] > 0
        assert record["violations"] == []
        assert record["width"] == 4  # both actor ranks padded to the wider shard
        assert record["metrics"] == {"actor/y": 2.0, "critic/x": 1.0}
    assert records[0]["total"] == records[1]["total"] == pytest.approx((0 * 2 + 1 * 2) * 10)
