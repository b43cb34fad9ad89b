"""Issue 45 items 1 and 4: a full disk ends in one line naming the last verified checkpoint and the resume
command, leaving nothing half-written; any checkpoint that fails verification is skipped with one message."""

from __future__ import annotations

import errno
import json
import shutil
import warnings

import pytest

import verl.checkpoint.manager as manager_mod
from tests.checkpoint.toy_train import train
from verl.checkpoint import CheckpointManager, verify
from verl.errors import DiskFullError
from verl.tracking.tracker import Tracker

RESUME = "verl train CONFIG trainer.resume=auto"


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device", "/fake/disk/file")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Checkpoints at steps 1, 2, 3 of the toy run, copied fresh for each test."""
    run = tmp_path_factory.mktemp("pristine")
    train(run, 3, save_interval=1)
    return run


@pytest.fixture
def run(pristine, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(pristine, dst)
    return dst


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("where", ["dcp", "extra"])
def test_full_disk_during_a_save(run, monkeypatch, where):
    root = run / "checkpoints"
    if where == "dcp":
        monkeypatch.setattr(manager_mod, "_dcp_save", _enospc)
    else:
        monkeypatch.setattr(manager_mod, "write_bytes_durable", _enospc)
    with pytest.raises(DiskFullError) as info:
        train(run, 4, save_interval=1, resume="auto")
    text = _one_line(info.value)
    assert text.startswith("saving checkpoint step 4 (into ") and "no space left on device" in text
    assert f"last verified checkpoint: {root / 'step_3'}" in text and RESUME in text
    # nothing half-written: no step_4, no .tmp- folder, `latest` unchanged and step_3 intact
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2", "step_3"]
    assert (root / "latest").read_text().strip() == "step_3" and verify(root / "step_3") == []


def test_full_disk_at_start(tmp_path, monkeypatch):
    monkeypatch.setattr(manager_mod.Path, "mkdir", _enospc)
    with pytest.raises(DiskFullError) as info:
        CheckpointManager(tmp_path / "new", save_interval=1)
    text = _one_line(info.value)
    assert "creating the checkpoint folder" in text and "no verified checkpoint yet" in text and RESUME in text


def test_run_dir_check_names_a_full_disk(tmp_path, monkeypatch):
    import tempfile

    from verl.config.loader import load_config
    from verl.trainer.checks.startup import check_run_dir

    monkeypatch.setattr(tempfile, "TemporaryDirectory", _enospc)
    cfg = load_config(overrides=[f"trainer.run_dir={tmp_path / 'run'}"])
    (problem,) = check_run_dir(cfg)
    assert isinstance(problem, DiskFullError) and "starting the run" in _one_line(problem) and RESUME in str(problem)


class _FullAfter:
    """A file handle that writes `n` characters of the next write, then fails as a full disk does."""

    def __init__(self, fh, n=5):
        self.fh, self.n = fh, n

    def write(self, text):
        self.fh.write(text[: self.n])
        self.fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        self.fh.flush()

    def close(self):
        self.fh.close()


def test_full_disk_in_metrics_and_samples(run, monkeypatch):
    tracker = Tracker(["jsonl"], run)
    tracker.log({"loss": 1.0}, 1)
    tracker._jsonl = _FullAfter(tracker._jsonl)
    with pytest.raises(DiskFullError) as info:
        tracker.log({"loss": 2.0}, 2)
    text = _one_line(info.value)
    assert f"writing step 2's metrics to {run / 'metrics.jsonl'}" in text
    assert f"last verified checkpoint: {run / 'checkpoints' / 'step_3'}" in text and RESUME in text
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]  # the half row was cut off again

    real_open = manager_mod.Path.open

    def full_open(self, *a, **k):
        fh = real_open(self, *a, **k)
        return _FullAfter(fh) if self.name == "samples.jsonl" and (a[:1] or [k.get("mode")])[0] == "a" else fh

    (run / "samples.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setattr(manager_mod.Path, "open", full_open)
    with pytest.raises(DiskFullError, match=r"writing step 2's validation samples to .*samples.jsonl"):
        tracker.log_samples([{"prompt": "p", "response": "r"}], 2)
    assert (run / "samples.jsonl").read_text() == '{"step": 1}\n'
    tracker.close()


def _garbage_manifest(step):
    (step / "manifest.json").write_text("{not json", encoding="utf-8")


def _truncated_extra(step):
    p = step / "extra" / "rank_00000.pt"
    p.write_bytes(p.read_bytes()[:100])


def _flipped_shard(step):
    p = step / "state" / "__0_0.distcp"
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x01
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, why, bad_file", [
    (_garbage_manifest, "unreadable", "manifest.json"),
    (_truncated_extra, "truncated", "extra/rank_00000.pt"),
    (_flipped_shard, "corrupt", "state/__0_0.distcp"),
])
def test_one_rule_for_damaged_checkpoints(run, damage, why, bad_file, capsys):
    from verl.cli.main import main

    root = run / "checkpoints"
    damage(root / "step_3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(run, 4, save_interval=1, resume="auto")  # resumes from step_2, saves 3 and 4 again
    messages = [str(w.message) for w in caught if "verify" in str(w.message)]
    assert len(messages) == 1, messages
    assert f"{root / 'step_3' / bad_file}" in messages[0] and why in messages[0]
    assert f"resuming from {root / 'step_2'} instead" in messages[0] and "\n" not in messages[0]
    assert (root / "latest").read_text().strip() == "step_4" and verify(root / "step_3") == []
    # `verl ckpt verify` names the same problem
    shutil.copytree(run / "checkpoints" / "step_2", run / "probe")
    damage(run / "probe")
    assert main(["ckpt", "verify", str(run / "probe")]) == 1
    err = capsys.readouterr().err
    assert str(run / "probe" / bad_file) in err and why in err


def test_latest_naming_a_missing_folder_is_one_message(run):
    root = run / "checkpoints"
    shutil.rmtree(root / "step_3")
    mgr = CheckpointManager(run, save_interval=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.find_resume("auto") == root / "step_2"
    (message,) = [str(w.message) for w in caught]
    assert f"{root / 'step_3'} (named by {root / 'latest'}): does not exist" in message


def test_check_warns_when_checkpoints_outgrow_the_disk(tmp_path, monkeypatch):
    from collections import namedtuple

    from verl.config.loader import load_config
    from verl.trainer.checks.startup import checkpoint_disk_warning

    usage = namedtuple("usage", "total used free")
    cfg = load_config(overrides=[f"trainer.run_dir={tmp_path / 'a' / 'b'}", "checkpoint.save_total_limit=2",
                                 "checkpoint.save_interval=1", "trainer.total_steps=10"])
    counts = {"actor": 1_000_000_000, "ref": 1_000_000_000}  # 1B parameters: 16 GB a checkpoint in float32
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 0, 10**12))
    assert checkpoint_disk_warning(cfg, counts, {"actor": "float32"}) == []
    seen = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: seen.append(p) or usage(10**12, 0, 20 * 1024**3))
    (warning,) = checkpoint_disk_warning(cfg, counts, {"actor": "float32"})
    assert seen == [tmp_path]  # the nearest folder that exists
    assert "a checkpoint is about 11.18 GiB" in warning and "up to 3 are on disk at once" in warning
    assert "20.00 GiB free" in warning and "checkpoint.save_total_limit" in warning
