"""A checkpoint saved by 2 gloo ranks loads in 1 process (DCP reshards; extras fall back to rank 0)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl.checkpoint import CheckpointManager, list_checkpoints

WORKER = Path(__file__).with_name("dist_worker.py")


@pytest.mark.dist
@pytest.mark.slow
def test_two_rank_save_one_rank_load(tmp_path, caplog):
    run = tmp_path / "run"
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(tmp_path / "init"), str(run)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    infos = list_checkpoints(run)
    assert [(i.step, i.verified, i.is_latest) for i in infos] == [(2, True, True)]  # keep-N=1 pruned step 1
    ckpt = infos[0].path
    assert sorted(p.name for p in (ckpt / "extra").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = CheckpointManager(run, save_interval=1)
    assert mgr.find_resume("auto") == ckpt
    extra = mgr.load(ckpt, app_state={"model": model, "optimizer": opt})
    assert extra["rank"] == 0
    expected = torch.load(run / "expected.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert opt.state_dict()["state"][0]["step"].item() == 2
    # a rank that did not exist at save time gets rank 0's extra state and a warning
    from verl.checkpoint.manager import load_checkpoint

    with caplog.at_level(logging.WARNING, logger="verl.checkpoint.load"):
        extra = load_checkpoint(ckpt, app_state={"model": model}, rank=5)
    assert extra["rank"] == 0 and "world_size=2" in caplog.text
