"""`run_code`: one execution of model-written Python in a fresh, limited, disposable process.

The program may be wrong or hostile (an endless loop, a fork bomb, a 50 GB allocation, a flood of output, a
write into the run folder, a read of the trainer's secrets, a socket, a kill of its parent): whatever it does
is contained by the limits below and the isolation of verl.sandbox.isolation, and the result says what
happened in `status` and `reason` instead of raising. Only a mistake of the caller (a bad limit, isolation
demanded that the host lacks) raises SandboxError.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from verl.errors import SandboxError
from verl.sandbox._init import sweep
from verl.sandbox.cgroup import RunCgroup
from verl.sandbox.isolation import DEFAULTS, SANDBOX_UID_BASE, Isolation, isolation
from verl.sandbox.launch import run_spec, start

Status = Literal["ok", "timeout", "memory", "killed", "error"]
_uids = itertools.count()
_uid_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended. `status`: ok (exit 0), timeout (wall clock or CPU time), memory (over memory_mb),
    killed (a signal, or output past max_output_bytes), error (a non-zero exit: an exception, a failed test).
    `reason` says why in words ("" when ok); `returncode` is the program's exit code, -N for signal N, None
    when it was stopped from outside."""

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    reason: str = ""
    peak_memory_mb: float | None = None  # all of the run's processes together, where a memory cgroup measures it

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _next_uid() -> int:
    with _uid_lock:  # a uid of its own per concurrent run of this process (and apart from other processes')
        return SANDBOX_UID_BASE + 1 + (os.getpid() % 500) * 200 + next(_uids) % 200


def _check_limits(**limits: float) -> None:
    bad = [f"{k}={v!r}" for k, v in limits.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0]
    if bad:
        raise SandboxError(f"run_code got {', '.join(bad)}; every limit must be a positive number.")


def _check_files(files: Mapping[str, str | bytes]) -> None:
    for name in files:
        path = Path(name)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise SandboxError(f"run_code files: {name!r} must be a relative path inside the working folder.")


class _Capped:
    """Reads a pipe to the end in a thread, keeping the first `cap` bytes; past that it calls `over`."""

    def __init__(self, stream: IO[bytes], cap: int, over: Callable[[], object]) -> None:
        self.data, self.exceeded = bytearray(), False
        self._thread = threading.Thread(target=self._read, args=(stream, cap, over), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes], cap: int, over: Callable[[], object]) -> None:
        while chunk := stream.read1(65536):
            room = cap - len(self.data)
            self.data += chunk[:max(room, 0)]
            if len(chunk) > room and not self.exceeded:
                self.exceeded = True
                over()

    def text(self, timeout_s: float) -> str:
        self._thread.join(timeout_s)
        return self.data.decode("utf-8", errors="replace")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def run_code(
    code: str,
    stdin: str = "",
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    cpu_s: float | None = None,
    max_processes: int = 16,
    max_open_files: int = 64,
    max_file_mb: int = 16,
    max_disk_mb: int = 64,
    max_output_bytes: int = 1 << 16,
    files: Mapping[str, str | bytes] | None = None,
    require: Iterable[str] | None = None,
    python: str | None = None,
    namespaces: bool = True,
) -> SandboxResult:
    """Run `code` (Python source) with `stdin`, in a fresh process that can harm nothing outside it.

    Limits: `timeout_s` wall clock (the whole process tree is killed), `cpu_s` CPU seconds (default the
    timeout), `memory_mb` for all of the run's processes together where the host has a memory cgroup (else per
    process: see Isolation.describe), `max_processes`, `max_open_files`, `max_file_mb` per file written,
    `max_disk_mb` for everything it writes (its folder and /tmp share one sized tmpfs, with a mount namespace),
    `max_output_bytes` per stream (past it the run is killed). `files` are written into the private working
    folder first (e.g. test inputs). `require`: isolation features the run must have (verl.sandbox.FEATURES);
    a host without one raises SandboxError naming the fix. `python` runs the code. Both default to what
    `verl.sandbox.configure` set (the run's `sandbox` config section). `namespaces=False` leaves out the
    namespaces and the filesystem view (the fallback every POSIX host has)."""
    _check_limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s or timeout_s, max_processes=max_processes,
                  max_open_files=max_open_files, max_file_mb=max_file_mb, max_disk_mb=max_disk_mb,
                  max_output_bytes=max_output_bytes)
    iso = isolation(python or DEFAULTS["python"], namespaces)
    iso.require(DEFAULTS["require"] if require is None else require, "run_code(require=...)")
    files = {**(files or {}), "main.py": code}
    _check_files(files)
    cgroup = iso.memory.create(int(memory_mb)) if iso.memory else None
    try:
        spec = run_spec(python=iso.python, uid=_next_uid() if iso.own_user else None, files=files,
                        view_dirs=iso.view_dirs, namespaces=iso.namespaces, cgroup=cgroup and cgroup.path,
                        tmp=tempfile.gettempdir(), cpu_s=max(1, int(-(-(cpu_s or timeout_s) // 1))),
                        memory_mb=int(memory_mb), max_processes=int(max_processes),
                        max_open_files=int(max_open_files), max_file_mb=int(max_file_mb),
                        max_disk_mb=int(max_disk_mb))
        return _execute(iso, spec, stdin, cgroup, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
    finally:
        if cgroup:
            cgroup.remove()


def _execute(iso: Isolation, spec: dict, stdin: str, cgroup: RunCgroup | None, *, timeout_s: float,
             max_output_bytes: int) -> SandboxResult:
    start_time = time.monotonic()
    proc, status_r = start(iso.unshare, spec)
    flooded: list[str] = []

    def over(stream: str) -> Callable[[], object]:
        return lambda: (flooded.append(stream), _kill_group(proc.pid))

    out, err = (_Capped(proc.stdout, max_output_bytes, over("stdout")),
                _Capped(proc.stderr, max_output_bytes, over("stderr")))
    threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True).start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        if not iso.namespaces:  # kill the program's processes; the first one reaps them (it is their subreaper)
            sweep(spec["uid"], proc.pid, keep=proc.pid, reap=False)
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
    _kill_group(proc.pid)  # what is left in the group: the whole tree in a namespace, stragglers otherwise
    proc.wait()
    duration = time.monotonic() - start_time
    with os.fdopen(status_r) as f:
        line = f.readline()
    stdout, stderr = out.text(1.0), err.text(1.0)
    fate = json.loads(line) if line.strip() else {}
    oom = cgroup.oom_kills() if cgroup else 0
    result = _result(fate, stdout, stderr, duration, timed_out=timed_out, flooded=flooded, timeout_s=timeout_s,
                     cpu_s=spec["cpu_s"], memory_mb=spec["memory_mb"], max_output_bytes=max_output_bytes, oom=oom)
    return dataclasses.replace(result, peak_memory_mb=cgroup.peak_mb() if cgroup else None)


def _feed(pipe: IO[bytes], data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass


def _result(fate: dict, stdout: str, stderr: str, duration: float, *, timed_out: bool, flooded: list[str],
            timeout_s: float, cpu_s: int, memory_mb: int, max_output_bytes: int, oom: int = 0) -> SandboxResult:
    def result(status: Status, returncode: int | None, reason: str) -> SandboxResult:
        return SandboxResult(status, returncode, stdout, stderr, round(duration, 4), reason)

    if timed_out:
        return result("timeout", None, f"ran past the {timeout_s:g} s wall-clock limit and was killed")
    if flooded:
        return result("killed", None, f"wrote more than {max_output_bytes} bytes to {flooded[0]} and was killed")
    if "setup_error" in fate:
        return result("error", None, f"the sandbox could not start: {fate['setup_error']}")
    together = (f"its processes together went past its {memory_mb} MB of memory (the kernel killed {oom} of them)"
                if oom else "")
    if together and fate.get("exit") != 0:
        return result("memory", -fate["signal"] if "signal" in fate else fate.get("exit"), together)
    if "signal" in fate:
        sig = fate["signal"]
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        if sig == signal.SIGXCPU:
            return result("timeout", -sig, f"used up its {cpu_s} s of CPU time ({name})")
        if "MemoryError" in stderr:
            return result("memory", -sig, f"ran out of its {memory_mb} MB of memory ({name})")
        return result("killed", -sig, f"killed by {name}")
    if "exit" not in fate:  # the first process itself died: the program killed its own process group
        return result("killed", None, "the sandbox's processes were killed (by the program itself)")
    code = fate["exit"]
    if code == 0:
        return result("ok", 0, "")
    if "MemoryError" in stderr:
        return result("memory", code, f"ran out of its {memory_mb} MB of memory (MemoryError)")
    if code == 126 and stderr.startswith("sandbox setup failed"):
        return result("error", code, _last_line(stderr))
    return result("error", code, _last_line(stderr) or f"exited with code {code}")


__all__ = ["SandboxResult", "Status", "run_code"]
