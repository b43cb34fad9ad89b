"""``manifest.json``: what a complete checkpoint contains, so that "complete" can be checked, not assumed.

The manifest lists every file of the checkpoint with its size and sha256, plus the format version, step,
world size, library versions and creation time. It carries a sha256 of its own canonical JSON, so an edit
or a flipped byte in the manifest itself is caught too. :func:`verify` re-hashes everything and returns the
problems as sentences that start with the offending file's path.
"""

from __future__ import annotations

import functools
import json
import platform
import time
from pathlib import Path
from typing import Any

from verl.checkpoint._fs import fsync_dir, sha256_bytes, sha256_file, write_bytes_durable
from verl.errors import CheckpointError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "verl-checkpoint"
FORMAT_VERSION = 1
DCP_DIR = "state"


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    """Versions recorded in every manifest, so a failed resume can be traced to an upgrade."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "verl"):  # metadata only: importing transformers costs seconds
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of every regular file below ``root``, except the manifest itself."""
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.relative_to(root).as_posix() != MANIFEST_NAME:
            out.append(p.relative_to(root).as_posix())
    return out


def build_manifest(
    root: Path,
    *,
    step: int,
    world_size: int,
    app_state_keys: list[str],
    known_hashes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Hash every file under ``root``, except those in ``known_hashes`` (relative path -> sha256), which
    the ranks that wrote them hashed already (each its own shards, in parallel)."""
    known_hashes = known_hashes or {}
    files = {}
    for rel in list_files(root):
        path = root / rel
        files[rel] = {
            "size": path.stat().st_size,
            "sha256": known_hashes.get(rel) or sha256_file(path),
        }
    now = time.time()
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "world_size": int(world_size),
        "app_state_keys": sorted(app_state_keys),
        "created_unix": now,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        "versions": dict(library_versions()),
        "files": files,
    }
    body["manifest_sha256"] = sha256_bytes(_canonical(body))
    return body


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    write_bytes_durable(root / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8"))
    fsync_dir(root)


def read_manifest(root: Path) -> dict[str, Any]:
    """Load and self-check ``manifest.json``; raises CheckpointError naming the file."""
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing. The checkpoint was never committed (a save was interrupted) or is not a "
            "verl checkpoint; use an earlier checkpoint."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc}); the manifest is corrupt.") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a {FORMAT_NAME} manifest.")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {manifest.get('format_version')!r}, this verl reads "
            f"{FORMAT_VERSION}; use the verl version that wrote it (versions: {manifest.get('versions')})."
        )
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != sha256_bytes(_canonical(body)):
        raise CheckpointError(
            f"{path}: its own checksum does not match its content; the manifest was edited or corrupted."
        )
    return manifest


def hash_share(files: dict[str, dict[str, Any]], rank: int, world_size: int) -> set[str]:
    """The files rank `rank` of `world_size` re-hashes when they verify a checkpoint together: the largest
    file first to the least loaded rank, so each reads about 1/world_size of the bytes. Every rank computes
    the same split from the same manifest."""
    loads, mine = [0] * world_size, set()
    for rel, info in sorted(files.items(), key=lambda kv: (-int(kv[1]["size"]), kv[0])):
        r = loads.index(min(loads))
        loads[r] += int(info["size"]) or 1
        if r == rank:
            mine.add(rel)
    return mine


def verify(path: str | Path, *, deep: bool = True, share: tuple[int, int] | None = None) -> list[str]:
    """Problems of the checkpoint at ``path`` (empty list = good). ``deep`` re-hashes every byte.

    Each problem starts with the full path of the file at fault. Besides the file list, the DCP metadata is
    read (safely) and every byte range it points at is checked to lie inside a listed file.

    ``share=(rank, world_size)``: this rank's part of a verification that every rank runs at once (the
    caller gathers the parts): it re-hashes only its :func:`hash_share` of the files; rank 0 also makes
    the cheap checks (manifest, sizes, listing, DCP ranges). The union of the parts is the full answer.
    """
    rank, world_size = share or (0, 1)
    lead = rank == 0
    root = Path(path)
    if not root.is_dir():
        return [f"{root}: not a directory; pass a checkpoint folder such as <run_dir>/checkpoints/step_100."
                ] if lead else []
    try:
        manifest = read_manifest(root)
    except CheckpointError as exc:
        return [str(exc)] if lead else []
    problems: list[str] = []
    files: dict[str, dict[str, Any]] = manifest["files"]
    mine = hash_share(files, rank, world_size) if deep else set()
    md_rel = f"{DCP_DIR}/.metadata"  # rank 0 hashes the DCP metadata: it reads it for the range check below
    mine = (mine | {md_rel}) if lead and deep else (mine - {md_rel})
    for rel, info in sorted(files.items()):
        fp = root / rel
        if not fp.is_file():
            if lead:
                problems.append(f"{fp}: missing (listed in {MANIFEST_NAME} with {info['size']} bytes).")
            continue
        size = fp.stat().st_size
        if size != info["size"]:
            if lead:
                problems.append(
                    f"{fp}: size {size} bytes, {MANIFEST_NAME} says {info['size']} (truncated or overwritten)."
                )
            continue
        if rel in mine:
            digest = sha256_file(fp)
            if digest != info["sha256"]:
                problems.append(
                    f"{fp}: sha256 {digest[:16]}... does not match {MANIFEST_NAME} "
                    f"({info['sha256'][:16]}...); the file is corrupt."
                )
    if not lead:
        return problems
    for rel in list_files(root):
        if rel not in files:
            problems.append(f"{root / rel}: not listed in {MANIFEST_NAME}; it was added after the commit.")
    if md_rel not in files:
        problems.append(f"{root / md_rel}: {MANIFEST_NAME} lists no DCP metadata; the checkpoint is incomplete.")
    elif not any(p.startswith(f"{root / md_rel}:") for p in problems):
        problems.extend(_check_dcp_ranges(root, files))
    return problems


def _check_dcp_ranges(root: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    from verl.checkpoint.dcp_io import read_metadata_safely

    try:
        md = read_metadata_safely(root / DCP_DIR / ".metadata")
    except CheckpointError as exc:
        return [str(exc)]
    problems = []
    for item in (md.storage_data or {}).values():
        rel = f"{DCP_DIR}/{item.relative_path}"
        if rel not in files:
            problems.append(f"{root / rel}: referenced by the DCP metadata but not in {MANIFEST_NAME}.")
        elif item.offset + item.length > files[rel]["size"]:
            problems.append(
                f"{root / rel}: DCP metadata needs bytes up to {item.offset + item.length}, the file has "
                f"{files[rel]['size']}; it is truncated."
            )
    return sorted(set(problems))
