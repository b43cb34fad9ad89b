"""`verl train --nproc N`: re-execute the same command under torchrun, one process per device.

The user types one command; we build the torchrun line so they never get the module path or the
rendezvous flags wrong, and refuse to nest torchrun inside torchrun.

torchrun runs in-process under `python -m verl.distributed.torchrun_quiet` (torchrun's arguments), which
ends with exit code 1 instead of torchrun's `ChildFailedError` traceback when a worker fails: the worker
has already printed its own error. Workers started this way get `VERL_RANK_ERRORS` (a folder): a verl
error is written there per rank, and the `verl` command that launched them prints each distinct error
once, with the ranks that raised it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from verl.errors import ConfigError, DeviceMappingError

_NPROC_FLAGS = ("--nproc", "--nproc_per_node", "--nproc-per-node", "--nnodes", "--node-rank", "--node_rank",
                "--rdzv-endpoint", "--rdzv_endpoint")
RANK_ERRORS_ENV = "VERL_RANK_ERRORS"  # folder where each worker writes the verl error it stopped on


def strip_nproc_flag(argv: Sequence[str]) -> list[str]:
    """Remove `--nproc N` / `--nproc=N` (and the multi-node launch flags) from argv so the children do not
    spawn again."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _NPROC_FLAGS:
            skip = True
            continue
        if any(arg.startswith(flag + "=") for flag in _NPROC_FLAGS):
            continue
        out.append(arg)
    return out


def build_torchrun_command(
    nproc: int,
    argv: Sequence[str],
    *,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    python: str | None = None,
) -> list[str]:
    """The torchrun command line for `verl <argv>` on `nproc` processes per node.

    `argv` is what follows `verl` (e.g. ["train", "cfg.yaml", "trainer.steps=10"]); a `--nproc` flag in it
    is dropped. Multi-node runs pass nnodes and a rendezvous endpoint (host:port of any node).
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError(
            f"--nproc {nproc!r}: the number of processes must be an integer >= 1. Fix: --nproc 2."
        )
    if nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes}: must be >= 1.")
    if nnodes > 1 and not rdzv_endpoint:
        raise ConfigError(
            f"--nnodes {nnodes} needs a rendezvous endpoint every node can reach. Fix: pass "
            f"--rdzv-endpoint HOST:PORT (the same on every node)."
        )
    cmd = [
        python or sys.executable,
        "-m",
        "verl.distributed.torchrun_quiet",  # torchrun, without the ChildFailedError traceback
        f"--nproc_per_node={nproc}",
        f"--nnodes={nnodes}",
    ]
    if nnodes > 1:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    else:
        cmd.append("--standalone")
    cmd += ["-m", "verl.cli.main", *strip_nproc_flag(argv)]
    return cmd


def multinode_options(args: Any) -> dict[str, Any]:
    """`--nnodes/--node-rank/--rdzv-endpoint` of `verl train` as `spawn_torchrun` keywords, checked together
    so a half-given multi-node launch fails here, on every node, before any process starts."""
    nnodes, node_rank, endpoint = int(args.nnodes or 1), args.node_rank, args.rdzv_endpoint
    if nnodes > 1 and not args.nproc:
        raise ConfigError(f"--nnodes {nnodes} without --nproc: say how many processes each node starts. "
                          "Fix: --nproc 8 --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:PORT.")
    if nnodes == 1 and (node_rank not in (None, 0) or endpoint):
        raise ConfigError("--node-rank/--rdzv-endpoint were given without --nnodes; they only mean something "
                          "for a multi-node run. Fix: add --nnodes N (the number of nodes), or drop them.")
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} with --nnodes {nnodes}: the node rank must be in "
                          f"0..{nnodes - 1}. Fix: number the nodes 0 to {nnodes - 1}, one per node.")
    if endpoint is not None and (":" not in endpoint or not endpoint.rsplit(":", 1)[1].isdigit()):
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT (e.g. node0.example:29400), the "
                          "same on every node.")
    return {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": endpoint}


def spawn_torchrun(
    nproc: int,
    argv: Sequence[str],
    *,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run `verl <argv>` under torchrun with `nproc` processes per node and return its exit code."""
    environ = dict(os.environ if env is None else env)
    if environ.get("TORCHELASTIC_RUN_ID") or environ.get("LOCAL_RANK"):
        raise ConfigError(
            "--nproc was given inside a torchrun worker (LOCAL_RANK is set). Fix: either launch with torchrun "
            "yourself or use `verl train --nproc N`, not both."
        )
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise DeviceMappingError(
            f"--nproc {nproc} but only {torch.cuda.device_count()} CUDA device(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Fix: --nproc "
            f"{torch.cuda.device_count()} or make more devices visible."
        )
    cmd = build_torchrun_command(nproc, argv, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
    return subprocess.call(cmd, env=environ)


def write_rank_error(exc: BaseException, folder: str | Path, rank: int) -> None:
    """Record the error this worker stops on, for the launching `verl` command to print once."""
    path = Path(folder) / f"rank-{rank}.json"
    path.write_text(json.dumps({"rank": rank, "type": type(exc).__name__, "message": str(exc)}), encoding="utf-8")


def read_rank_errors(folder: str | Path) -> list[tuple[str, str, list[int]]]:
    """(type, message, ranks) for each distinct error the workers recorded, in order of the lowest rank."""
    grouped: dict[tuple[str, str], list[int]] = {}
    records = []
    for path in Path(folder).glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # a worker killed while writing: its own output says what happened
    for rec in sorted(records, key=lambda r: r["rank"]):
        grouped.setdefault((rec["type"], rec["message"]), []).append(rec["rank"])
    return [(kind, message, ranks) for (kind, message), ranks in grouped.items()]


def run_torchrun_quietly(argv: Sequence[str]) -> int:
    """torchrun with `argv`; a failed worker ends it with exit code 1 and a one-line summary, not a traceback."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the agent's "failed (exitcode: 1)" / "Sending closing signal" lines: the summary below says it once
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(parse_args(list(argv)))
    except ChildFailedError as exc:
        failures = ", ".join(f"rank {rank} (exit code {f.exitcode})" for rank, f in sorted(exc.failures.items()))
        folder = os.environ.get(RANK_ERRORS_ENV)
        recorded = {r for _, _, ranks in read_rank_errors(folder) for r in ranks} if folder else set()
        if not set(exc.failures) <= recorded:  # some worker did not stop on a verl error it recorded
            print(f"torchrun: worker(s) failed: {failures}; their output above says why.", file=sys.stderr)
        return 1
    return 0


__all__ = ["RANK_ERRORS_ENV", "build_torchrun_command", "multinode_options", "read_rank_errors",
           "run_torchrun_quietly", "spawn_torchrun", "strip_nproc_flag", "write_rank_error"]

