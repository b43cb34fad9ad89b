"""How a sandbox run starts: the first process (verl/sandbox/_init.py) under the host's command prefix, with its
spec (limits, isolation, the files of its folder) on a pipe, so the launcher writes nothing to disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

INIT = str(Path(__file__).with_name("_init.py"))
# What the code's process sees: nothing of the trainer's environment.
BASE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0"}


def run_spec(*, python: str, uid: int | None, files: Mapping[str, str | bytes], view_dirs: tuple[str, ...] | None,
             namespaces: bool, cgroup: str | None, tmp: str, cpu_s: int, memory_mb: int, max_processes: int,
             max_open_files: int, max_file_mb: int, max_disk_mb: int) -> dict[str, Any]:
    """The spec _init.py reads. `view_dirs`: the interpreter's folders outside /usr that the filesystem view
    holds (None: no view); `namespaces`: a mount and PID namespace (private /tmp; the run dies with it)."""
    home = "/tmp" if namespaces else "."
    return {"uid": uid, "main": "main.py", "python": python, "filesystem": view_dirs, "private_tmp": namespaces,
            "pid_namespace": namespaces, "cgroup": cgroup, "tmp": tmp,
            "env": {**BASE_ENV, "HOME": home, "TMPDIR": home},
            "files": {name: {"latin1": c.decode("latin-1")} if isinstance(c, bytes) else c
                      for name, c in files.items()},
            "cpu_s": cpu_s, "memory_mb": memory_mb, "max_processes": max_processes, "max_open_files": max_open_files,
            "max_file_mb": max_file_mb, "max_disk_mb": max_disk_mb}


def start(prefix: tuple[str, ...], spec: Mapping[str, Any]) -> tuple[subprocess.Popen, int]:
    """Start a run; returns its first process and the read end of its status pipe (one JSON line at the end)."""
    status_r, status_w = os.pipe()
    spec_r, spec_w = os.pipe()
    try:
        proc = subprocess.Popen([*prefix, sys.executable, "-I", "-S", "-B", INIT, str(spec_r)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                                env=dict(BASE_ENV), pass_fds=(status_w, spec_r), start_new_session=True)
    except BaseException:
        for fd in (status_r, spec_w):
            os.close(fd)
        raise
    finally:
        os.close(status_w)
        os.close(spec_r)
    data = json.dumps({**spec, "status_fd": status_w}).encode()
    threading.Thread(target=_write_all, args=(spec_w, data), daemon=True).start()  # a spec may outgrow the pipe
    return proc, status_r


def _write_all(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:  # the run died before reading it; its status says so
        pass


__all__ = ["BASE_ENV", "INIT", "run_spec", "start"]
