"""Async save: snapshot at save(), commit only after the background write verified, failures are loud."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import verl.checkpoint.manager as manager_mod
from tests.checkpoint.toy_train import train
from verl.checkpoint import CheckpointManager
from verl.errors import DiskFullError

real_dcp_save = manager_mod._dcp_save


def _slow_save(*args, **kwargs):
    time.sleep(0.3)
    return real_dcp_save(*args, **kwargs)


def _disk_full(state_dict, path, pg, no_dist):
    path.mkdir(parents=True, exist_ok=True)
    (path / "__0_0.distcp").write_bytes(b"\0" * 100)  # a partial shard, as a full disk leaves it
    raise OSError(28, "No space left on device")


def test_snapshot_then_commit_after_write(tmp_path, monkeypatch):
    monkeypatch.setattr(manager_mod, "_dcp_save", _slow_save)
    model = torch.nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(tmp_path, save_interval=1, async_save=True) as mgr:
        handle = mgr.save(1, app_state={"model": model}, extra={"step": 1})
        with torch.no_grad():  # training goes on while the write is in flight
            model.weight.add_(1.0)
        assert not handle.done()
        root = tmp_path / "checkpoints"
        assert not (root / "step_1").exists() and not (root / "latest").exists()  # not committed yet
        assert handle.result() == root / "step_1"
        assert (root / "latest").read_text().strip() == "step_1"
        fresh = torch.nn.Linear(4, 4)
        assert mgr.load(root / "step_1", app_state={"model": fresh}) == {"step": 1}
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)  # the snapshot, not the mutation


def test_failed_background_save_is_loud_and_never_latest(tmp_path, monkeypatch, caplog):
    mgr = CheckpointManager(tmp_path, save_interval=1, async_save=True)
    state = {"w": {"t": torch.ones(3)}}
    mgr.save(1, app_state=state, extra={})
    mgr.wait()
    monkeypatch.setattr(manager_mod, "_dcp_save", _disk_full)
    with caplog.at_level(logging.ERROR, logger="verl.checkpoint.manager"):
        mgr.save(2, app_state=state, extra={})  # returns at once; the failure happens in the background
        with pytest.raises(DiskFullError,
                           match=r"step 2 .*no space left on device.*last verified checkpoint: .*step_1"):
            mgr.wait()
    assert "ASYNC CHECKPOINT FAILED for step 2" in caplog.text
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]  # the partial folder is gone
    # a failure nobody waited for surfaces at the next save (and at close)
    mgr.save(3, app_state=state, extra={})
    with pytest.raises(DiskFullError, match="step 3"):
        mgr.save(4, app_state=state, extra={})
    mgr.save(5, app_state=state, extra={})
    with pytest.raises(DiskFullError, match="step 5"):
        mgr.close()
    assert (root / "latest").read_text().strip() == "step_1"


def test_async_run_resumes_bit_exact(tmp_path):
    ref, ref_metrics = train(tmp_path / "ref", 7, save_interval=0)
    train(tmp_path / "run", 4, save_interval=2, async_save=True)
    model, metrics = train(tmp_path / "run", 7, save_interval=2, resume="auto", async_save=True)
    assert metrics == ref_metrics
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True))
