"""`run_code`: one execution of model-written Python in a fresh, limited, disposable process.

The program may be wrong or hostile (an endless loop, a fork bomb, a 50 GB allocation, a flood of output, a
write into the run folder, a read of the trainer's secrets, a socket, a kill of its parent): whatever it does
is contained by the limits below and the isolation of verl.sandbox.isolation, and the result says what
happened in `status` and `reason` instead of raising. Only a mistake of the caller (a bad limit, isolation
demanded that the host lacks) raises SandboxError.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from verl.errors import SandboxError
from verl.sandbox._init import sweep
from verl.sandbox.isolation import DEFAULTS, SANDBOX_UID_BASE, Isolation, isolation

Status = Literal["ok", "timeout", "memory", "killed", "error"]
INIT = str(Path(__file__).with_name("_init.py"))
# What the code's process sees: nothing of the trainer's environment.
BASE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0"}
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


def _write_files(work: Path, files: Mapping[str, str | bytes]) -> None:
    for name, content in files.items():
        path = Path(name)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise SandboxError(f"run_code files: {name!r} must be a relative path inside the working folder.")
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_bytes(content.encode() if isinstance(content, str) else content)


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


def _remove(path: str) -> None:
    def unlock(fn, p, _exc) -> None:  # the program may have taken its own permissions away
        os.chmod(os.path.dirname(p), 0o700)
        os.chmod(p, 0o700) if os.path.isdir(p) else None
        fn(p)

    shutil.rmtree(path, onerror=unlock)


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
    max_output_bytes: int = 1 << 16,
    files: Mapping[str, str | bytes] | None = None,
    require: Iterable[str] | None = None,
    python: str | None = None,
    namespaces: bool = True,
) -> SandboxResult:
    """Run `code` (Python source) with `stdin`, in a fresh process that can harm nothing outside it.

    Limits: `timeout_s` wall clock (the whole process tree is killed), `cpu_s` CPU seconds (default the
    timeout), `memory_mb` address space, `max_processes`, `max_open_files`, `max_file_mb` per file written,
    `max_output_bytes` per stream (past it the run is killed). `files` are written into the private working
    folder first (e.g. test inputs). `require`: isolation features the run must have (verl.sandbox.FEATURES);
    a host without one raises SandboxError naming the fix. `python` runs the code. Both default to what
    `verl.sandbox.configure` set (the run's `sandbox` config section). `namespaces=False` leaves out the namespaces (the
    fallback every POSIX host has)."""
    _check_limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s or timeout_s, max_processes=max_processes,
                  max_open_files=max_open_files, max_file_mb=max_file_mb, max_output_bytes=max_output_bytes)
    iso = isolation(python or DEFAULTS["python"], namespaces)
    iso.require(DEFAULTS["require"] if require is None else require, "run_code(require=...)")
    base = tempfile.mkdtemp(prefix="verl-sandbox-")
    try:
        work = Path(base) / "work"
        work.mkdir()
        _write_files(work, {**(files or {}), "main.py": code})
        uid = _next_uid() if iso.own_user else None
        if uid is not None:
            os.chmod(base, 0o711)
            for path in [work, *work.rglob("*")]:
                os.chown(path, uid, uid)
        return _execute(iso, base, work, uid, stdin, timeout_s=timeout_s, cpu_s=cpu_s or timeout_s,
                        memory_mb=memory_mb, max_processes=max_processes, max_open_files=max_open_files,
                        max_file_mb=max_file_mb, max_output_bytes=max_output_bytes)
    finally:
        _remove(base)


def _execute(iso: Isolation, base: str, work: Path, uid: int | None, stdin: str, *, timeout_s: float, cpu_s: float,
             memory_mb: int, max_processes: int, max_open_files: int, max_file_mb: int,
             max_output_bytes: int) -> SandboxResult:
    status_r, status_w = os.pipe()
    spec = {"status_fd": status_w, "uid": uid, "workdir": str(work), "main": "main.py", "python": iso.python,
            "env": {**BASE_ENV, **dict.fromkeys(("HOME", "TMPDIR"), "/tmp" if iso.namespaces else str(work))}, "private_tmp": iso.namespaces,
            "pid_namespace": iso.namespaces, "cpu_s": max(1, int(-(-cpu_s // 1))), "memory_mb": int(memory_mb),
            "max_processes": int(max_processes), "max_open_files": int(max_open_files),
            "max_file_mb": int(max_file_mb)}
    start = time.monotonic()
    proc = subprocess.Popen([*iso.unshare, sys.executable, "-I", "-S", "-B", INIT, json.dumps(spec)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=base,
                            env=dict(BASE_ENV), pass_fds=(status_w,), start_new_session=True)
    os.close(status_w)
    flooded: list[str] = []

    def over(stream: str) -> Callable[[], object]:
        return lambda: (flooded.append(stream), _kill_group(proc.pid))

    out, err = _Capped(proc.stdout, max_output_bytes, over("stdout")), _Capped(proc.stderr, max_output_bytes, over("stderr"))
    threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True).start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        if not iso.namespaces:  # kill the program's processes; the first one reaps them (it is their subreaper)
            sweep(uid, proc.pid, keep=proc.pid, reap=False)
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
    _kill_group(proc.pid)  # what is left in the group: the whole tree in a namespace, stragglers otherwise
    proc.wait()
    duration = time.monotonic() - start
    with os.fdopen(status_r) as f:
        line = f.readline()
    stdout, stderr = out.text(1.0), err.text(1.0)
    fate = json.loads(line) if line.strip() else {}
    return _result(fate, stdout, stderr, duration, timed_out=timed_out, flooded=flooded, timeout_s=timeout_s,
                   cpu_s=spec["cpu_s"], memory_mb=memory_mb, max_output_bytes=max_output_bytes)


def _feed(pipe: IO[bytes], data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass


def _result(fate: dict, stdout: str, stderr: str, duration: float, *, timed_out: bool, flooded: list[str],
            timeout_s: float, cpu_s: int, memory_mb: int, max_output_bytes: int) -> SandboxResult:
    def result(status: Status, returncode: int | None, reason: str) -> SandboxResult:
        return SandboxResult(status, returncode, stdout, stderr, round(duration, 4), reason)

    if timed_out:
        return result("timeout", None, f"ran past the {timeout_s:g} s wall-clock limit and was killed")
    if flooded:
        return result("killed", None, f"wrote more than {max_output_bytes} bytes to {flooded[0]} and was killed")
    if "setup_error" in fate:
        return result("error", None, f"the sandbox could not start: {fate['setup_error']}")
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
