"""Finding the checkpoint a run resumes from: `latest` first, skipping (and naming) every one that does not verify."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from verl.checkpoint.layout import _STEP_RE, CHECKPOINTS_DIR, LATEST_NAME, _committed_steps, read_latest
from verl.checkpoint.manifest import MANIFEST_NAME
from verl.errors import CheckpointError

logger = logging.getLogger(__name__)


class ResumeSearch:
    """`CheckpointManager`'s resume side (its `rank`, `root`, `_verify` and `_broadcast_object` are the manager's)."""

    def find_resume(self, resume: str | Path | None) -> Path | None:
        """``"never"``/None -> None; ``"auto"`` -> the ``latest`` checkpoint, or if it does not verify the
        newest one that does (or None);
        a path -> that checkpoint (a step folder) or the newest good one under it (a run folder),
        raising CheckpointError naming the file when it does not verify.

        Collective: rank 0 lists the candidates, then every rank re-hashes its share of each one it tries,
        and every rank reaches the same answer (or raises the same error)."""
        if resume is None or resume == "never":
            return None
        plan: tuple[str, Any] | None = None
        if self.rank == 0:
            try:
                plan = self._resume_candidates(resume)
            except CheckpointError as exc:
                plan = ("error", str(exc))
        plan = self._broadcast_object(plan)
        if plan[0] == "error":
            raise CheckpointError(plan[1])
        if plan[0] == "one":
            path = Path(plan[1])
            problems = self._verify(path)
            if problems:
                raise CheckpointError(
                    f"trainer.resume={resume}: the checkpoint does not verify:\n  " + "\n  ".join(problems)
                    + "\nUse an earlier checkpoint, or trainer.resume=auto to pick the newest good one."
                )
            return path
        _, root, candidates, required = plan
        return self._newest_verified(Path(root), [Path(c) for c in candidates], required=required)

    def _resume_candidates(self, resume: str | Path) -> tuple[Any, ...]:
        """Rank 0's reading of `resume`: ("one", step folder) or ("newest", root, folders to try in order,
        whether one is required); raises CheckpointError for a path that does not exist."""
        if resume == "auto":
            return ("newest", str(self.root), self._candidates(self.root), False)
        path = Path(resume)
        if not path.exists():
            raise CheckpointError(
                f"trainer.resume={resume}: no such file or folder; pass a checkpoint folder "
                "(<run_dir>/checkpoints/step_<N>), a run folder, 'auto' or 'never'."
            )
        if (path / MANIFEST_NAME).exists() or _STEP_RE.match(path.name):
            return ("one", str(path))
        root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
        return ("newest", str(root), self._candidates(root), True)

    @staticmethod
    def _candidates(root: Path) -> list[str]:
        # `latest` first: after resuming from an older checkpoint, newer folders of the abandoned run may
        # still exist, and the run we are continuing is the one `latest` names
        candidates = [p for _, p in reversed(_committed_steps(root))]
        latest = read_latest(root)
        candidates.sort(key=lambda p: p.name != latest)  # stable: the rest stay newest first
        return [str(p) for p in candidates]

    def _newest_verified(self, root: Path, candidates: list[Path], *, required: bool) -> Path | None:
        """The first candidate that verifies. One rule for every damaged file (manifest, shards, DCP metadata,
        extra state): the checkpoint is skipped, and ONE warning names each one skipped, why, and the one
        used instead (every rank decides the same; rank 0 says so)."""
        skipped = []
        latest = read_latest(root)
        if latest is not None and not (root / latest).is_dir() and _STEP_RE.match(latest):
            skipped.append(f"{root / latest} (named by {root / LATEST_NAME}): does not exist")
        for path in candidates:
            problems = self._verify(path)
            if not problems:
                if skipped:
                    self._say_skipped(skipped, f"resuming from {path} instead")
                return path
            skipped.append(f"{path}: " + "; ".join(problems))
        if required:
            raise CheckpointError(
                f"{root}: no checkpoint that verifies" + (":\n  " + "\n  ".join(skipped) if skipped else ".")
            )
        if skipped:
            self._say_skipped(skipped, "no checkpoint verifies; starting fresh from step 0")
        return None

    def _say_skipped(self, skipped: list[str], outcome: str) -> None:
        if self.rank != 0:
            return
        what = ("a checkpoint that does not verify" if len(skipped) == 1
                else f"{len(skipped)} checkpoints that do not verify")
        msg = f"skipped {what} ({'; '.join(skipped)}); {outcome}. `verl ckpt verify PATH` re-checks one."
        logger.info(msg)  # for log files; the warning is what a console shows, once
        warnings.warn(msg, UserWarning, stacklevel=4)
