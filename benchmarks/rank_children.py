"""Fresh child processes as the ranks of a gloo group, for benchmarks that measure one rank against several
(benchmarks/sequence_parallel.py, benchmarks/tensor_parallel.py): each child is the script itself with
`--child`, prints one JSON line, and its resident memory is read from /proc."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_kib() -> int:
    """This process's resident memory now, in KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, child_args: list[str], size: int) -> list[dict]:
    """`size` fresh `script --child` processes (1: one rank, no group, no --rank), one torch thread each; their
    JSON lines, by rank."""
    base = [sys.executable, script, "--child", *child_args, "--size", str(size), "--port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([*base, *(["--rank", str(r)] if size > 1 else [])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(size)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"a child failed ({p.returncode}):\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])
