"""Leftovers of a save killed at any moment are removed at the next start, files and folders alike."""

from verl.checkpoint import CheckpointManager


def test_interrupted_pointer_and_folders_are_cleaned(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest.tmp-4318").write_text("step_3\n")  # killed between writing `latest` and the rename
    (root / "step_3.tmp-0a1b").mkdir()
    (root / "step_2.deleting-ff00").mkdir()
    (root / "notes.txt").write_text("mine")  # not ours: left alone
    CheckpointManager(tmp_path, save_interval=1).close()
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
