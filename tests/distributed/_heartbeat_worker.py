"""Two gloo ranks for test_heartbeat.py: rank 1 stops itself (SIGSTOP: its heartbeat thread stops with it)
after a guarded 'reduce:sum' at step 7; rank 0 waits for it at the next collective (a 7 s timeout), then
resumes it (SIGCONT) once its heartbeat named rank 1, or after 20 s."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _dist_workers import setup


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from verl.distributed import heartbeat
    from verl.distributed.guard import CollectiveGuard
    from verl.errors import DistributedError

    setup(rank, world, port)
    said: list[tuple[float, str]] = []  # (when, what) of every heartbeat message
    beat = heartbeat.start_heartbeat(2.0, timeout_s=30, log=lambda m: said.append((time.monotonic(), m)))
    guard = CollectiveGuard(timeout_s=30)
    guard.run("reduce:sum", (0, 1), lambda: dist.all_reduce(torch.ones(1)))
    heartbeat.note(step=7)
    pid_file = Path(out_dir, "pid1")
    record: dict = {}
    short = CollectiveGuard(timeout_s=7, namespace="short")
    if rank == 1:
        time.sleep(1.0)  # a beat (every 0.5 s) carries the stage and step: a hang comes later than its last beat
        pid_file.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        short.arrive("after_stop", (0, 1))  # resumed: the last to arrive, it passes
    else:
        waiting = time.monotonic()
        try:
            try:
                short.arrive("after_stop", (0, 1))  # rank 1 is stopped meanwhile: a timeout after 7 s
            except DistributedError as err:
                record["timeout"], record["timeout_after_s"] = str(err), time.monotonic() - waiting
            deadline = waiting + 20
            while time.monotonic() < deadline and not any("no heartbeat" in m for m in beat.messages):
                time.sleep(0.05)
        finally:
            while not pid_file.exists():
                time.sleep(0.05)
            os.kill(int(pid_file.read_text()), signal.SIGCONT)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("answers again" in m for m in beat.messages):
            time.sleep(0.05)
        record["pid1"] = int(pid_file.read_text())
        record["silent_after_s"] = min((t for t, m in said if "no heartbeat" in m), default=1e9) - waiting
    record["messages"] = list(beat.messages)
    Path(out_dir, f"heartbeat{rank}.json").write_text(json.dumps(record))
    heartbeat.stop_heartbeat()
    dist.barrier()
    dist.destroy_process_group()
