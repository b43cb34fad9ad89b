"""CheckpointManager: exact resume, atomic commit, keep-N, policy and the errors users hit."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import verl.checkpoint.manager as manager_mod
from tests.checkpoint.toy_train import train
from verl.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    verify,
)
from verl.errors import CheckpointError, ConfigError


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resume_is_bit_exact(tmp_path):
    ref_model, ref_metrics = train(tmp_path / "ref", 9, save_interval=0)
    train(tmp_path / "run", 5, save_interval=3)  # saves at 3 and 5 (last step), then "crashes"
    model, metrics = train(tmp_path / "run", 9, save_interval=3, resume="auto")
    assert _same_weights(model, ref_model)
    assert metrics == ref_metrics  # metrics restored from the checkpoint + identical continuation
    # without restoring RNG/sampler/scheduler state the run would differ: prove the test can fail
    other, _ = train(tmp_path / "other", 9, save_interval=0, seed=1)
    assert not _same_weights(other, ref_model)


def test_resume_from_explicit_path_and_never(tmp_path):
    train(tmp_path / "run", 6, save_interval=3)
    ref, _ = train(tmp_path / "ref", 8, save_interval=0)
    step3 = tmp_path / "run" / "checkpoints" / "step_3"
    mgr = CheckpointManager(tmp_path / "run", save_interval=3)
    assert mgr.find_resume(str(step3)) == step3
    assert mgr.find_resume("never") is None
    assert mgr.find_resume(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_6"
    model, _ = train(tmp_path / "run", 8, save_interval=0, resume=str(step3))
    assert _same_weights(model, ref)


def test_auto_follows_latest_after_resuming_from_an_older_checkpoint(tmp_path):
    train(tmp_path, 6, save_interval=3)  # steps 3 and 6
    train(tmp_path, 4, save_interval=1, resume=str(tmp_path / "checkpoints" / "step_3"))  # a new branch: 4
    mgr = CheckpointManager(tmp_path, save_interval=1)
    assert mgr.find_resume("auto") == tmp_path / "checkpoints" / "step_4"  # not the abandoned step_6
    (tmp_path / "checkpoints" / "step_4" / "extra" / "rank_00000.pt").unlink()
    with pytest.warns(UserWarning, match="step_4"):
        assert mgr.find_resume("auto") == tmp_path / "checkpoints" / "step_6"


def test_layout_manifest_and_latest(tmp_path):
    train(tmp_path, 4, save_interval=2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_4"
    m = json.loads((root / "step_4" / "manifest.json").read_text())
    assert m["step"] == 4 and m["world_size"] == 1 and m["format_version"] == 1
    assert set(m["versions"]) >= {"torch", "transformers", "verl"}
    assert set(m["files"]) == {"state/.metadata", "state/__0_0.distcp", "extra/rank_00000.pt"}
    data = (root / "step_4" / "state" / "__0_0.distcp").read_bytes()
    import hashlib

    assert m["files"]["state/__0_0.distcp"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert m["app_state_keys"] == ["model", "optimizer"]
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_should_save_policy(tmp_path):
    mgr = CheckpointManager(tmp_path, save_interval=5)
    assert [s for s in range(1, 13) if mgr.should_save(s, s == 12)] == [5, 10, 12]
    never = CheckpointManager(tmp_path, save_interval=0)
    assert [s for s in range(1, 13) if never.should_save(s, s == 12)] == [12]


@pytest.mark.parametrize("kwargs, key", [({"save_interval": -1}, "checkpoint.save_interval"),
                                         ({"save_interval": 1, "save_total_limit": 0}, "save_total_limit")])
def test_bad_policy_values(tmp_path, kwargs, key):
    with pytest.raises(ConfigError, match=key):
        CheckpointManager(tmp_path, **kwargs)


def test_keep_n_keeps_newest_and_never_latest(tmp_path):
    train(tmp_path, 7, save_interval=1, save_total_limit=2)
    assert [i.step for i in list_checkpoints(tmp_path)] == [6, 7]
    # newer checkpoints from an abandoned future (a resume from earlier) never push out the one just written
    mgr = CheckpointManager(tmp_path, save_interval=1, save_total_limit=1)
    mgr.save(3, app_state={"w": {"t": torch.zeros(2)}}, extra={})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step_3" in names and (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert len([n for n in names if n.startswith("step_")]) == 1


def test_crash_before_rename_leaves_previous_state(tmp_path, monkeypatch):
    """A crash between manifest and rename: nothing new becomes visible; the leftover is cleaned up."""
    mgr = CheckpointManager(tmp_path, save_interval=1)
    state = {"w": {"t": torch.arange(4.0)}}
    mgr.save(1, app_state=state, extra={"a": 1})
    real_rename = manager_mod.os.rename

    def crash(src, dst):
        if str(dst).endswith("step_2"):  # the commit rename; DCP's own renames go through
            raise KeyboardInterrupt("simulated crash")  # not an Exception: nothing catches or cleans up
        return real_rename(src, dst)

    monkeypatch.setattr(manager_mod.os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, app_state=state, extra={"a": 2})
    monkeypatch.setattr(manager_mod.os, "rename", real_rename)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_1"
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name]  # the partial save exists on disk...
    assert mgr.find_resume("auto") == root / "step_1"  # ...and is never considered
    CheckpointManager(tmp_path, save_interval=1)  # next start-up removes it
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]


def test_resave_same_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, save_interval=1)
    t = {"w": {"t": torch.zeros(3)}}
    mgr.save(2, app_state=t, extra={"v": 1})
    t["w"]["t"] += 5
    mgr.save(2, app_state=t, extra={"v": 2})
    out = {"w": {"t": torch.empty(3)}}
    assert mgr.load(tmp_path / "checkpoints" / "step_2", app_state=out) == {"v": 2}
    assert torch.equal(out["w"]["t"], torch.full((3,), 5.0))
    assert verify(tmp_path / "checkpoints" / "step_2") == []


def test_app_state_kinds_roundtrip(tmp_path):
    """Modules, paired optimizers, objects with state_dict() and plain dicts all come back."""
    torch.manual_seed(0)
    critic = torch.nn.Linear(3, 1)
    copt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(copt, step_size=1, gamma=0.5)
    critic(torch.randn(2, 3)).sum().backward()
    copt.step()
    sched.step()
    mgr = CheckpointManager(tmp_path, save_interval=1)
    mgr.save(1, app_state={"critic": critic, "critic_optimizer": copt, "stats": {"mean": torch.tensor([1.5])}},
             extra={"sched": sched.state_dict()})
    critic2 = torch.nn.Linear(3, 1)
    copt2 = torch.optim.SGD(critic2.parameters(), lr=0.1, momentum=0.9)
    stats2 = {"mean": torch.zeros(1)}
    extra = mgr.load(mgr.find_resume("auto"), app_state={"critic": critic2, "critic_optimizer": copt2,
                                                         "stats": stats2})
    assert _same_weights(critic, critic2)
    buf1 = copt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(copt2.state_dict()["state"][0]["momentum_buffer"], buf1)
    assert copt2.param_groups[0]["lr"] == copt.param_groups[0]["lr"]
    assert stats2["mean"].item() == 1.5 and extra["sched"]["last_epoch"] == 1


def test_unpaired_optimizer_and_bad_state_are_named(tmp_path):
    mgr = CheckpointManager(tmp_path, save_interval=1)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1)
    with pytest.raises(CheckpointError, match=r"app_state\['actor_optimizer'\] is an optimizer.*'actor'"):
        mgr.save(1, app_state={"actor_optimizer": opt}, extra={})
    with pytest.raises(CheckpointError, match=r"app_state\['n'\] is a int"):
        mgr.save(1, app_state={"n": 3}, extra={})
    with pytest.raises(CheckpointError, match=r"extra\['arr'\] cannot be loaded back.*numpy array as a tensor"):
        mgr.save(1, app_state={}, extra={"ok": 1, "arr": np.zeros(3)})
    assert not (tmp_path / "checkpoints" / "latest").exists()


def test_load_into_a_different_kind_of_run_is_explained(tmp_path):
    mgr = CheckpointManager(tmp_path, save_interval=1)
    m = torch.nn.Linear(2, 2)
    mgr.save(1, app_state={"model": m}, extra={})
    with pytest.raises(CheckpointError, match=r"no state for 'critic' \(it holds model\).*trainer.resume=never"):
        load_checkpoint(tmp_path / "checkpoints" / "step_1", app_state={"model": m, "critic": torch.nn.Linear(2, 1)})
    with pytest.raises(CheckpointError, match="model or optimizer differs"):
        load_checkpoint(tmp_path / "checkpoints" / "step_1", app_state={"model": torch.nn.Linear(3, 2)})


def test_rng_roundtrip_float64_reference():
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in the legacy state
    state = capture_rng_state()
    expect = (random.random(), np.random.standard_normal(), torch.rand(3, dtype=torch.float64))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(state)
    got = (random.random(), np.random.standard_normal(), torch.rand(3, dtype=torch.float64))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    with pytest.raises(CheckpointError, match="capture_rng_state"):
        restore_rng_state({"python": {}})


def test_a_resume_keeps_this_process_optimizer_kernel_flags(tmp_path):
    """`fused`/`foreach` say how this process steps (the fused kernel takes plain tensors only), not what it
    learnt: a checkpoint saved with the fused kernel, loaded where it does not apply (a resume at another
    tensor-parallel size: DTensor parameters), keeps the live flags, and its Adam moments load."""
    def parts(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1, **({"fused": True} if fused else {}))

    model, opt = parts(fused=True)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    CheckpointManager(tmp_path, save_interval=1).save(1, app_state={"model": model, "optimizer": opt}, extra={})
    fresh, fresh_opt = parts(fused=False)
    CheckpointManager(tmp_path, save_interval=1).load(tmp_path / "checkpoints" / "step_1",
                                                      app_state={"model": fresh, "optimizer": fresh_opt})
    assert fresh_opt.param_groups[0].get("fused") in (None, False)  # as built here, not as saved
    assert _same_weights(fresh, model)
    saved, loaded = opt.state[model.weight], fresh_opt.state[fresh.weight]
    assert torch.equal(saved["exp_avg"], loaded["exp_avg"]) and float(loaded["step"]) == 1.0
