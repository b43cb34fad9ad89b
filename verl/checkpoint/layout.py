"""The checkpoint folder's names and what is committed in it (steps, `latest`), read without torch."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from verl.checkpoint.best import BestRecord, read_best
from verl.checkpoint.manifest import read_manifest, verify
from verl.errors import CheckpointError

CHECKPOINTS_DIR = "checkpoints"
LATEST_NAME = "latest"
EXTRA_DIR = "extra"
HF_DIR = "hf"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Leftovers of an interrupted save: a step folder being written, deleted or swapped, or the `latest`
# pointer's temporary file (killed between its write and the rename).
_TRASH_RE = re.compile(r"^(step_\d+\.(tmp|deleting|old)-[0-9a-f]+|(latest|best\.json)\.tmp-\d+)$")


def extra_file(rank: int) -> str:
    return f"{EXTRA_DIR}/rank_{rank:05d}.pt"


@dataclass
class CheckpointInfo:
    """One entry of :meth:`CheckpointManager.list` / :func:`list_checkpoints`."""

    step: int
    path: Path
    size_bytes: int
    created: str | None
    is_latest: bool
    problems: list[str] | None  # None: not verified (verify=False)
    best: BestRecord | None = None  # the checkpoint.keep_best record, on the checkpoint it names

    @property
    def verified(self) -> bool:
        return self.problems is not None and not self.problems


def _checkpoints_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def _committed_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_latest(root: Path) -> str | None:
    """Folder name in ``<checkpoints>/latest``, or None."""
    try:
        return (root / LATEST_NAME).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def list_checkpoints(run_dir: str | Path, *, verify_files: bool = True) -> list[CheckpointInfo]:
    """Every committed checkpoint under ``run_dir`` (or a ``checkpoints`` folder), oldest first."""
    run_dir = Path(run_dir)
    root = run_dir if run_dir.name == CHECKPOINTS_DIR else _checkpoints_root(run_dir)
    latest = read_latest(root)
    best = read_best(root)
    infos = []
    for step, path in _committed_steps(root):
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        created = None
        try:
            created = read_manifest(path).get("created")
        except CheckpointError:
            pass
        infos.append(
            CheckpointInfo(
                step=step,
                path=path,
                size_bytes=size,
                created=created,
                is_latest=path.name == latest,
                problems=verify(path) if verify_files else None,
                best=best if best is not None and best.folder == path.name else None,
            )
        )
    return infos
