"""Damaged checkpoints: `verify` names the file, `auto` falls back, a named PATH is refused."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch

from tests.checkpoint.toy_train import train
from verl.checkpoint import CheckpointManager, verify
from verl.checkpoint.dcp_io import read_metadata_safely
from verl.cli.ckpt_cmd import register
from verl.errors import CheckpointError


def _ckpt_cli(argv):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ckpt", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A run with checkpoints at steps 2 and 4, copied fresh for each test."""
    run = tmp_path_factory.mktemp("pristine")
    train(run, 4, save_interval=2)
    return run


@pytest.fixture
def run(pristine, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(pristine, dst)
    return dst


def _truncate(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x01
    p.write_bytes(bytes(data))


def _delete(p):
    p.unlink()


@pytest.mark.parametrize("damage, expect", [(_truncate, "size"), (_flip, "sha256"), (_delete, "missing")])
@pytest.mark.parametrize("rel", ["state/__0_0.distcp", "state/.metadata", "extra/rank_00000.pt"])
def test_damage_is_named_and_auto_falls_back(run, damage, expect, rel, capsys):
    step4 = run / "checkpoints" / "step_4"
    damage(step4 / rel)
    problems = verify(step4)
    assert problems and all(p.startswith(str(step4 / rel)) for p in problems) and expect in problems[0]
    # the CLI exits 1 and names the file
    assert _ckpt_cli(["verify", str(step4)]) == 1
    assert str(step4 / rel) in capsys.readouterr().err
    mgr = CheckpointManager(run, save_interval=2)
    with pytest.warns(UserWarning, match=r"step_4.*" + expect):
        assert mgr.find_resume("auto") == run / "checkpoints" / "step_2"
    with pytest.raises(CheckpointError, match=rf"does not verify:\n  {step4 / rel}"):
        mgr.find_resume(str(step4))


def test_good_checkpoint_passes_cli(run, capsys):
    assert _ckpt_cli(["verify", str(run / "checkpoints" / "step_4")]) == 0
    assert "OK" in capsys.readouterr().out
    assert _ckpt_cli(["list", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["step", "verified", "size", "created", "latest"]
    assert out[1].split()[:2] == ["2", "yes"] and out[2].split()[:2] == ["4", "yes"] and "*" in out[2].split()


def test_list_marks_bad_checkpoint(run, capsys):
    _flip(run / "checkpoints" / "step_4" / "state" / "__0_0.distcp")
    assert _ckpt_cli(["list", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[2].split()[:2] == ["4", "NO"]
    assert "__0_0.distcp" in captured.err


def test_edited_manifest_and_added_file(run):
    step4 = run / "checkpoints" / "step_4"
    m = json.loads((step4 / "manifest.json").read_text())
    m["step"] = 5
    (step4 / "manifest.json").write_text(json.dumps(m))
    assert "its own checksum does not match" in verify(step4)[0]
    step2 = run / "checkpoints" / "step_2"
    (step2 / "state" / "stray.bin").write_bytes(b"x")
    assert verify(step2) == [
        f"{step2 / 'state' / 'stray.bin'}: not listed in manifest.json; it was added after the commit."]


def test_all_bad_auto_starts_fresh_and_path_errors(run):
    for step in (2, 4):
        _truncate(run / "checkpoints" / f"step_{step}" / "state" / "__0_0.distcp")
    mgr = CheckpointManager(run, save_interval=2)
    with pytest.warns(UserWarning, match="no checkpoint verifies"):
        assert mgr.find_resume("auto") is None
    with pytest.raises(CheckpointError, match="no checkpoint that verifies"):
        mgr.find_resume(str(run))
    with pytest.raises(CheckpointError, match="no such file or folder.*'auto' or 'never'"):
        mgr.find_resume(str(run / "nope"))


def test_malicious_metadata_is_not_unpickled(run):
    """DCP's .metadata is a pickle; a crafted one must not run code even if the manifest agrees."""
    target = run / "checkpoints" / "step_4" / "state" / ".metadata"

    class Evil:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pwned')",))

    buf = io.BytesIO()
    pickle.dump(Evil(), buf)
    target.write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError, match=r"\.metadata: DCP metadata is unreadable or references a forbidden"):
        read_metadata_safely(target)
    from verl.checkpoint.manager import load_checkpoint

    with pytest.raises(CheckpointError, match="forbidden type"):  # the load path uses the safe reader too
        load_checkpoint(run / "checkpoints" / "step_4", app_state={"model": torch.nn.Linear(16, 256)})


def test_extra_file_is_loaded_weights_only(run):
    """A pickled object in an extra file (with a forged manifest) is refused, not executed."""
    mgr = CheckpointManager(run, save_interval=2)
    step2 = run / "checkpoints" / "step_2"

    class Evil:
        def __reduce__(self):
            return (exec, ("raise SystemExit('pwned')",))

    torch.save({"x": Evil()}, step2 / "extra" / "rank_00000.pt")
    from verl.checkpoint.manager import load_checkpoint

    with pytest.raises(CheckpointError, match=r"rank_00000.pt: cannot be loaded with weights_only=True"):
        load_checkpoint(step2, app_state={})
    del mgr
