"""`verl train` in 1..N gloo processes, as a user launches it, for the multi-process trainer tests."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TIMEOUT_S = 600


def verl_train(config: Path, cwd: Path, nproc: int = 1, script: Path | None = None,
               launcher: str = "fork") -> subprocess.CompletedProcess:
    """Run `verl train CONFIG` on `nproc` ranks with what torchrun exports; fails the test with the output tail.

    `launcher="fork"` forks the ranks from this process, which has torch and transformers imported already
    (about 7 s of CPU per rank saved: most of a tiny run); `"torchrun"` starts them the way a user does, in
    fresh interpreters. `script` runs `python SCRIPT CONFIG` instead of `verl train` (e.g. a trainer subclass).
    """
    if launcher == "torchrun":
        out = _torchrun(config, cwd, nproc, script)
    else:
        out = _forked(config, cwd, nproc, script)
    assert out.returncode == 0, _tails(out.stdout + out.stderr)
    return out


def _tails(text: str, chars: int = 3000) -> str:
    """The end of each rank's output: the failing rank is often not the last one printed."""
    parts = re.split(r"^(\[rank \d+ exit .*?\]\n)", text, flags=re.MULTILINE)
    if len(parts) == 1:
        return text[-2 * chars:]
    return parts[0][-chars:] + "".join(head + body[-chars:]
                                       for head, body in zip(parts[1::2], parts[2::2], strict=True))


def _torchrun(config: Path, cwd: Path, nproc: int, script: Path | None) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    entry = [str(script)] if script is not None else ["-m", "verl.cli.main", "train"]
    args = [sys.executable, *launcher, *entry, str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=cwd)


def free_port() -> int:
    """A free port for a process to bind later, below the OS's ephemeral range.

    A port the OS hands out for port 0 can be handed out again, to another test's gloo socket, before the
    process meant to bind it does (it happened in CI beside the slow suite: rank 1 then waited ten minutes
    for a store that never started). Below the ephemeral range only an explicit bind takes a port.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(10000, max(low, 10200)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rendezvous(rank0_hosts: bool = False) -> Iterator[dict[str, str]]:
    """The rendezvous variables for ranks started on this machine, while the `with` lasts.

    By default this process hosts the store, as torchrun's agent does, and the ranks join it as clients:
    the OS picks its port as it binds, so nothing can take the port first. With `rank0_hosts` (the layout
    of launchers without an agent) rank 0 binds a `free_port` later.
    """
    import torch.distributed as dist

    if rank0_hosts:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        return
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def _forked(config: Path, cwd: Path, nproc: int, script: Path | None, *, rank0_hosts: bool = False,
            survivors_s: float | None = 60.0) -> subprocess.CompletedProcess:
    """The ranks as forked children; the result reads like torchrun's: exit 0 when every rank exited 0.

    Like torchrun, once a rank has failed the others are stopped (after `survivors_s`, time to print their
    own view of it), rather than left waiting in a collective until the test's timeout; None leaves them be.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    logs = [Path(tempfile.mkstemp(prefix=f"rank{rank}_", suffix=".log")[1]) for rank in range(nproc)]
    ctx = multiprocessing.get_context("fork")
    with rendezvous(rank0_hosts) if nproc > 1 else contextlib.nullcontext({}) as env:  # one rank: no store
        ranks = [ctx.Process(target=_rank, args=(rank, nproc, env, config, cwd, script, logs[rank]))
                 for rank in range(nproc)]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        while (alive := [p for p in ranks if p.is_alive()]) and time.monotonic() < deadline:
            if survivors_s is not None and any(p.exitcode for p in ranks):
                deadline = min(deadline, time.monotonic() + survivors_s)
                survivors_s = None
            wait([p.sentinel for p in alive], max(deadline - time.monotonic(), 0))
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join()
    codes = [p.exitcode for p in ranks]
    text = "".join(f"[rank {r} exit {c}]\n" + log.read_text(errors="replace") for r, (c, log)
                   in enumerate(zip(codes, logs, strict=True)))
    for log in logs:
        log.unlink()
    return subprocess.CompletedProcess(["verl", "train", str(config)], max(abs(c or 0) for c in codes), text, "")


def _rank(rank: int, nproc: int, rendezvous_env: dict[str, str], config: Path, cwd: Path, script: Path | None,
          log: Path) -> None:
    """One rank in a forked child: its output to `log`, torchrun's environment, then `verl train`."""
    fd = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if nproc > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", TORCHELASTIC_RUN_ID=f"forked-{rendezvous_env['MASTER_PORT']}",
                          **rendezvous_env)
    code = 1
    try:
        if script is not None:
            sys.argv = [str(script), str(config)]
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        else:
            from verl.cli.main import main

            code = main(["train", str(config)]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
