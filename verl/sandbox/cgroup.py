"""One memory limit for all of a sandbox run's processes: a memory cgroup of its own (v2 `memory.max`, or v1
`memory.limit_in_bytes`), made under the launcher's own cgroup where the launcher may write there.

RLIMIT_AS bounds each process, so without a cgroup a run may hold memory_mb x max_processes (and shared memory
a process has not mapped, such as a memfd, counts toward no process's limit). A cgroup counts every page its
processes own, page cache, tmpfs and memfd included, and its OOM killer acts inside the run only.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

_runs = itertools.count()
V2_FILES = ("memory.max", "memory.swap.max", "memory.events", "memory.peak")
V1_FILES = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control", "memory.max_usage_in_bytes")


def _memory_hierarchy() -> tuple[str, bool] | None:
    """The folder of this process's memory cgroup and whether it is cgroup v2; None when there is none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for fields in mounts:
            rest = fields[fields.index("-") + 1:]
            if v2 and rest[0] == "cgroup2" or not v2 and rest[0] == "cgroup" and "memory" in rest[2].split(","):
                folder = os.path.join(fields[4], os.path.relpath(path, fields[3]))
                if os.path.isdir(folder):
                    return os.path.normpath(folder), v2
    return None


@dataclass(frozen=True)
class MemoryCgroups:
    """Where this process may make a run's cgroup: `parent` (its own cgroup) and the interface's files."""

    parent: str
    v2: bool

    @property
    def files(self) -> tuple[str, str, str, str]:
        return V2_FILES if self.v2 else V1_FILES

    def create(self, memory_mb: int) -> RunCgroup:
        path = os.path.join(self.parent, f"verl-sandbox-{os.getpid()}-{next(_runs)}")
        os.mkdir(path)
        limit, swap, _, _ = self.files
        try:
            _write(os.path.join(path, limit), str(memory_mb * 2**20))
            if os.path.exists(os.path.join(path, swap)):  # no swapping past the limit either
                _write(os.path.join(path, swap), "0" if self.v2 else str(memory_mb * 2**20))
        except OSError:
            os.rmdir(path)
            raise
        return RunCgroup(path, self)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


@dataclass(frozen=True)
class RunCgroup:
    path: str
    kind: MemoryCgroups

    def oom_kills(self) -> int:
        """How many of the run's processes the kernel killed for going past the limit."""
        text = _read(os.path.join(self.path, self.kind.files[2]))
        counts = [int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")]
        return counts[0] if counts else 0

    def peak_mb(self) -> float | None:
        text = _read(os.path.join(self.path, self.kind.files[3])).strip()
        return round(int(text) / 2**20, 1) if text.isdigit() else None

    def remove(self, wait_s: float = 2.0) -> None:
        """Remove the cgroup once its last process is gone (a killed process takes a moment to be reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # left empty-bound; removed by the next process's sweep of stale cgroups
                time.sleep(0.02)


def _remove_stale(parent: str) -> None:
    """Cgroups of launchers that died (SIGKILLed mid-run): empty now, so removable."""
    for name in os.listdir(parent):
        if name.startswith("verl-sandbox-"):
            pid = name.split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


def memory_cgroups() -> MemoryCgroups | None:
    """Where this host lets this process limit a run's memory, checked by making (and removing) one."""
    found = _memory_hierarchy()
    if found is None:
        return None
    kind = MemoryCgroups(*found)
    try:
        _remove_stale(kind.parent)
        kind.create(64).remove()
    except OSError:
        return None
    return kind


__all__ = ["MemoryCgroups", "RunCgroup", "memory_cgroups"]
