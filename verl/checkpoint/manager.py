"""CheckpointManager: saves that are complete and verified, or do not exist.

Layout (one folder per committed step; the DCP keys are the ``app_state`` keys)::

    <run_dir>/checkpoints/
      latest                      text file "step_<N>", replaced atomically after each commit
      best.json                   checkpoint.keep_best: the step of the best validation value (verl.checkpoint.best)
      step_<N>/
        manifest.json             every file with size + sha256, format version, step, world size,
                                  library versions, creation time, app_state keys, own checksum
                                  (each rank hashes the files it wrote; rank 0 gathers the hashes)
        state/                    torch.distributed.checkpoint: .metadata + __<rank>_<i>.distcp
                                  keys "model.<fqn>", "optimizer.state.<fqn>.<name>",
                                  "critic.<fqn>", "critic_optimizer...", any other app_state key
        extra/rank_<RRRRR>.pt     torch.save of this rank's `extra` dict (lr scheduler, sampler,
                                  trainer state, RNG states, resolved config text); weights_only-loadable
        hf/                       optional: config.json, generation_config.json, tokenizer files
      step_<N>.tmp-<token>/       a save in progress; never read, removed at the next start-up

A save writes into ``step_<N>.tmp-<token>/``, fsyncs every file and directory, writes the manifest, checks
the files against it (sizes, DCP byte ranges, the extra files' hashes against the bytes in memory), then
renames the folder to ``step_<N>/`` and rewrites ``latest``. A crash at any moment leaves the previous
checkpoints plus at most a ``.tmp-`` folder that nothing reads.

With ``async_save=True`` the state is copied to host memory and everything above runs on a background
thread; the next ``save`` (and ``wait``/``close``) waits for it and raises ``CheckpointError`` if it failed,
so a run can never go on for days without its checkpoints landing.

Several ranks: every rank constructs the manager (it creates a gloo group for checkpoint traffic) and calls
``save``/``find_resume``/``load`` at the same steps. ``run_dir`` must be on a filesystem all ranks share;
rank 0 writes the manifest and commits. Hashing is shared: at save each rank hashes its own shards and
extra file (rank 0 gathers the hashes into the manifest), and at resume each rank re-hashes about
1/world_size of the bytes, so neither stalls the run on one rank reading every shard (minutes at 7B).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from verl.checkpoint._fs import (
    atomic_write_text,
    fsync_dir,
    fsync_tree,
    sha256_bytes,
    sha256_file,
    write_bytes_durable,
)
from verl.checkpoint.best import BestRecord, read_best, write_best
from verl.checkpoint.dcp_io import read_metadata_safely, to_state_dict, top_level_keys
from verl.checkpoint.layout import (
    _TRASH_RE,
    CHECKPOINTS_DIR,
    EXTRA_DIR,
    HF_DIR,
    LATEST_NAME,
    CheckpointInfo,
    _checkpoints_root,
    _committed_steps,
    extra_file,
    list_checkpoints,
    read_latest,
)
from verl.checkpoint.load import _quiet_single_process, describe_error, load_checkpoint
from verl.checkpoint.manifest import (
    DCP_DIR,
    build_manifest,
    verify,
    write_manifest,
)
from verl.checkpoint.resume import ResumeSearch
from verl.checkpoint.save_parts import CheckpointHandle, serialize_extra
from verl.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    VerlError,
    disk_full_cause,
    disk_full_error,
)

# The layout's names, listing, loading and the save's parts live in modules of their own; importable from here too.
__all__ = [
    "CHECKPOINTS_DIR",
    "EXTRA_DIR",
    "HF_DIR",
    "LATEST_NAME",
    "CheckpointHandle",
    "CheckpointInfo",
    "CheckpointManager",
    "describe_error",
    "extra_file",
    "list_checkpoints",
    "load_checkpoint",
    "read_latest",
    "serialize_extra",
]

logger = logging.getLogger(__name__)


def _dcp_save(state_dict: dict[str, Any], path: Path, pg: Any, no_dist: bool) -> None:
    """One place that writes DCP data (tests replace it to simulate a failing disk)."""
    with _quiet_single_process():
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
            process_group=pg,
            no_dist=no_dist,
        )


class CheckpointManager(ResumeSearch):
    """Saves, verifies, prunes and finds checkpoints of one run (see the module docstring for the layout)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        save_interval: int,
        save_total_limit: int | None = None,
        async_save: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not isinstance(save_interval, int) or save_interval < 0:
            raise ConfigError(
                f"checkpoint.save_interval={save_interval!r}: must be an integer >= 0 (0 saves only on the "
                "last step and on SIGTERM/SIGINT)."
            )
        if save_total_limit is not None and (not isinstance(save_total_limit, int) or save_total_limit < 1):
            raise ConfigError(
                f"checkpoint.save_total_limit={save_total_limit!r}: must be null (keep all) or an integer "
                ">= 1."
            )
        self.run_dir = Path(run_dir)
        self.root = _checkpoints_root(self.run_dir)
        self.save_interval = save_interval
        self.save_total_limit = save_total_limit
        self.async_save = async_save
        self.rank = rank
        self.world_size = world_size
        self._distributed = dist.is_available() and dist.is_initialized()
        if world_size > 1 and not self._distributed:
            raise DistributedError(
                f"CheckpointManager(world_size={world_size}) needs torch.distributed to be initialised "
                "first (torchrun + init_process_group), or world_size=1."
            )
        if self._distributed:
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise DistributedError(
                    f"CheckpointManager got rank={rank}, world_size={world_size} but the process group has "
                    f"rank={dist.get_rank()}, world_size={dist.get_world_size()}; pass the group's values."
                )
            # a dedicated CPU group: checkpoint collectives may run on a background thread and must not
            # interleave with the trainer's NCCL collectives
            self._pg = dist.new_group(backend="gloo")
        else:
            self._pg = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: CheckpointHandle | None = None
        self._stager: Any = None
        if rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._clean_leftovers()
            except OSError as exc:
                if (cause := disk_full_cause(exc)) is None:
                    raise
                raise self._disk_full(cause, f"creating the checkpoint folder {self.root}") from exc
        self._barrier()

    def last_verified(self) -> Path | None:
        """The checkpoint `trainer.resume=auto` would continue from (manifest and sizes checked, no re-hash)."""
        if not self.root.is_dir():
            return None
        for candidate in self._candidates(self.root):
            if not verify(candidate, deep=False):
                return Path(candidate)
        return None

    def _disk_full(self, cause: OSError, what: str) -> VerlError:
        return disk_full_error(cause, what, self.run_dir, last_checkpoint=self.last_verified())

    # ------------------------------------------------------------------ policy
    def should_save(self, step: int, is_last: bool = False) -> bool:
        """Save on every ``save_interval``-th step and on the last step."""
        return is_last or (self.save_interval > 0 and step % self.save_interval == 0)

    # ------------------------------------------------------------------ collectives
    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _gather_to_rank0(self, value: Any) -> list[Any] | None:
        """Every rank's `value` on rank 0 (None elsewhere); small picklable values between our own ranks."""
        if self._pg is None:
            return [value]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, out, dst=dist.get_global_rank(self._pg, 0), group=self._pg)
        return out

    def _broadcast_object(self, value: Any) -> Any:
        if self._pg is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._pg, 0), group=self._pg)
        return box[0]

    def _verify(self, path: Path) -> list[str]:
        """`verify(path)` with the hashing shared by every rank (all must call it); every rank gets the
        whole list of problems."""
        if self._pg is None:
            return verify(path)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, verify(path, share=(self.rank, self.world_size)), group=self._pg)
        return [problem for part in parts for problem in part]

    def _own_hashes(self, tmp: Path, extra_bytes: bytes) -> dict[str, str]:
        """sha256 of the files this rank wrote: its extra file (checked against the bytes it meant to write)
        and its DCP shards (DCP names them ``__<rank>_<i>.distcp``; any file no rank claims is hashed by
        rank 0 when it builds the manifest, so nothing goes unlisted)."""
        rel = extra_file(self.rank)
        got = sha256_file(tmp / rel)
        if got != sha256_bytes(extra_bytes):
            raise CheckpointError(f"{tmp / rel}: bytes on disk differ from what rank {self.rank} wrote.")
        hashes = {rel: got}
        pg_rank = dist.get_rank(self._pg) if self._pg is not None else 0
        for shard in sorted((tmp / DCP_DIR).glob(f"__{pg_rank}_*.distcp")):
            hashes[f"{DCP_DIR}/{shard.name}"] = sha256_file(shard)
        return hashes

    def _broadcast_int(self, value: int) -> int:
        if self._pg is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=dist.get_global_rank(self._pg, 0), group=self._pg)
        return int(t.item())

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        *,
        app_state: dict[str, object],
        extra: dict[str, object],
        hf_assets: Sequence[object] = (),
        best: BestRecord | None = None,
    ) -> CheckpointHandle:
        """Write checkpoint ``step``; returns when committed (sync) or when the state is snapshot (async).

        ``app_state``: modules, optimizers (paired with their module, see ``verl.checkpoint.dcp_io``),
        objects with ``state_dict()``, or plain dicts of tensors -> DCP. ``extra``: this rank's small
        states -> ``torch.save``. ``hf_assets``: objects with ``save_pretrained(dir)`` (HF config,
        generation config, tokenizer) written by rank 0 into ``hf/`` for ``verl ckpt export``. ``best``: this
        checkpoint becomes the run's best (``best.json``, spared by the rotation) once it is committed.
        """
        self.wait()  # one save in flight at a time; raises if the previous one failed
        token = f"{self._broadcast_int(secrets.randbits(62)):016x}"
        tmp = self.root / f"step_{step}.tmp-{token}"
        final = self.root / f"step_{step}"
        extra_bytes = serialize_extra(extra)
        state_dict = to_state_dict(app_state)
        if self.rank == 0:
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                if hf_assets:
                    (tmp / HF_DIR).mkdir()
                    for asset in hf_assets:
                        if not hasattr(asset, "save_pretrained"):
                            shutil.rmtree(tmp, ignore_errors=True)
                            raise CheckpointError(
                                f"hf_assets item {type(asset).__name__} has no save_pretrained(dir); pass the "
                                "model config, generation config and tokenizer."
                            )
                        asset.save_pretrained(str(tmp / HF_DIR))  # type: ignore[attr-defined]
            except OSError as exc:
                if (cause := disk_full_cause(exc)) is None:
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # a save in progress is never read; free its space now
                raise self._disk_full(cause, f"saving checkpoint step {step} (into {tmp})") from exc
        self._barrier()  # the folder exists before any rank writes into it
        job_args = (step, tmp, final, state_dict, extra_bytes, sorted(state_dict), best)
        if not self.async_save:
            self._write_and_commit(*job_args)
            return CheckpointHandle(step, final)
        state_dict = self._stage(state_dict)
        job_args = (step, tmp, final, state_dict, extra_bytes, sorted(state_dict), best)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-ckpt")
        future = self._executor.submit(self._write_and_commit_logged, *job_args)
        self._pending = CheckpointHandle(step, final, future)
        return self._pending

    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A private host-memory copy, so training can keep mutating the live tensors."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(False, False, False, False))
        return self._stager.stage(state_dict)  # type: ignore[return-value]

    def _write_and_commit_logged(self, *args: Any) -> None:
        try:
            self._write_and_commit(*args)
        except BaseException as exc:
            logger.error(
                "ASYNC CHECKPOINT FAILED for step %s: %s: %s -- it was NOT committed and `latest` is "
                "unchanged; the next save()/wait() raises.",
                args[0],
                type(exc).__name__,
                exc,
            )
            raise

    def _write_and_commit(
        self,
        step: int,
        tmp: Path,
        final: Path,
        state_dict: dict[str, Any],
        extra_bytes: bytes,
        keys: list[str],
        best: BestRecord | None = None,
    ) -> None:
        error: BaseException | None = None
        hashes: dict[str, str] = {}
        try:
            write_bytes_durable(tmp / extra_file(self.rank), extra_bytes)
            # DCP's coordinator finishes only after every rank wrote its data (and so its extra file)
            _dcp_save(state_dict, tmp / DCP_DIR, self._pg, self._pg is None)
            hashes = self._own_hashes(tmp, extra_bytes)
        except (Exception, CheckpointException) as exc:
            error = exc
        gathered = self._gather_to_rank0(None if error is not None else hashes)
        any_failed = gathered is not None and any(part is None for part in gathered)
        if rank0_commits := (self.rank == 0 and not any_failed):
            try:
                known = {rel: sha for part in gathered for rel, sha in part.items()}
                self._commit(step, tmp, final, known, keys, best)
            except Exception as exc:
                error = exc
        committed = self._broadcast_int(1 if rank0_commits and error is None else 0)
        if committed:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if (cause := disk_full_cause(error)) is not None:
            raise self._disk_full(cause, f"saving checkpoint step {step} (into {tmp})") from error
        if isinstance(error, CheckpointError):
            raise error
        if error is None:
            raise CheckpointError(
                f"checkpoint step {step}: another rank failed to write its part, nothing was committed; "
                "see the other ranks' logs."
            )
        raise CheckpointError(
            f"writing checkpoint step {step} to {tmp} failed on rank {self.rank}: "
            f"{describe_error(error)}. Nothing was committed; check free disk space and "
            "permissions of the run directory."
        ) from error

    def _commit(self, step: int, tmp: Path, final: Path, known_hashes: dict[str, str], keys: list[str],
                best: BestRecord | None = None) -> None:
        for r in range(self.world_size):
            if not (tmp / extra_file(r)).is_file():
                raise CheckpointError(f"{tmp / extra_file(r)}: rank {r} did not write its extra state.")
        if (tmp / HF_DIR).is_dir():
            fsync_tree(tmp / HF_DIR)  # written by save_pretrained, which does not fsync
        fsync_tree(tmp, files=False)  # DCP shards and extra files were fsynced by the rank that wrote them
        # ranks may hold different keys (roles on different ranks): list what DCP wrote for all of them
        keys = sorted(set(keys) | top_level_keys(read_metadata_safely(tmp / DCP_DIR / ".metadata")))
        manifest = build_manifest(tmp, step=step, world_size=self.world_size, app_state_keys=keys,
                                  known_hashes=known_hashes)
        write_manifest(tmp, manifest)
        problems = verify(tmp, deep=False)
        if problems:
            raise CheckpointError("checkpoint failed verification before commit:\n  " + "\n  ".join(problems))
        old = None
        if final.exists():  # re-saving a step (e.g. after resuming before it): keep it until the swap
            old = final.with_name(f"{final.name}.old-{tmp.name.rsplit('-', 1)[1]}")
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.root)
        atomic_write_text(self.root / LATEST_NAME, final.name + "\n")
        if best is not None:
            write_best(self.root, best)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint step %d committed at %s", step, final)
        self._prune(final)

    def _prune(self, just_written: Path) -> None:
        if self.save_total_limit is None:
            return
        protected = {just_written.name, read_latest(self.root)}
        committed = [p for _, p in _committed_steps(self.root)]
        others = [p for p in reversed(committed) if p.name not in protected]
        keep = max(self.save_total_limit - sum(1 for p in committed if p.name in protected), 0)
        best = read_best(self.root)  # kept apart from the newest save_total_limit, not counted among them
        for victim in [p for p in others[keep:] if best is None or p.name != best.folder]:
            trash = victim.with_name(f"{victim.name}.deleting-{secrets.token_hex(4)}")
            os.rename(victim, trash)  # atomic: a crash mid-delete never leaves a half step_<N>
            shutil.rmtree(trash, ignore_errors=True)
            logger.info("save_total_limit=%d: deleted %s", self.save_total_limit, victim)
        fsync_dir(self.root)

    def set_best(self, record: BestRecord | None) -> None:
        """Make `record` the run's best (None: no best, its folder rotates like the others); rank 0 writes.
        The trainer calls it at start-up with the best as of the checkpoint it resumes from."""
        if self.rank == 0 and (record is not None or read_best(self.root) is not None):
            write_best(self.root, record)

    def _clean_leftovers(self) -> None:
        for p in self.root.iterdir():
            if not _TRASH_RE.match(p.name):
                continue
            if ".old-" in p.name:
                base = p.with_name(p.name.split(".old-")[0])
                if not base.exists():  # crashed mid-swap: the old one is the complete one
                    os.rename(p, base)
                    continue
            logger.warning("removing %s, left over by an interrupted save", p)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ async bookkeeping
    def wait(self) -> None:
        """Block until the pending async save is committed; raise CheckpointError if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Finish (or report) pending saves and release the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ resume
    def load(self, path: str | Path, *, app_state: dict[str, object]) -> dict[str, Any]:
        """Restore ``app_state`` in place from checkpoint ``path``; return this rank's ``extra`` dict.

        With a different world size than at save time, DCP reshards the model/optimizer state; ``extra``
        comes from this rank's file if there is one, else from rank 0's (with a warning, since per-rank
        RNG streams cannot be carried over exactly).
        """
        return load_checkpoint(path, app_state=app_state, rank=self.rank, process_group=self._pg)
