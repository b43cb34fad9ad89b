"""What isolation this host can give a sandbox run, found once per process.

Always (POSIX): resource limits, a process group killed as a whole, an empty environment and a private
working folder. Where the launcher is root, each run also gets a uid of its own (nothing of the host is its
own, RLIMIT_NPROC counts only its processes, it cannot signal the trainer). Where util-linux `unshare` can
make namespaces (root, or unprivileged user namespaces), the run also gets no network, its own PID
namespace (its processes die with it; it cannot see the trainer's), a filesystem view of its own (a fresh root
holding the interpreter read-only and the run folder, on a sized tmpfs) and dies with its launcher. Where the
launcher may make a memory cgroup, one limit bounds all of a run's processes together.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from verl.errors import SandboxError
from verl.sandbox.cgroup import MemoryCgroups, memory_cgroups
from verl.sandbox.launch import run_spec, start

# What a user may demand (sandbox.require), and what provides it.
FEATURES = {
    "network": "no network (a network namespace of its own)",
    "pid": "a PID namespace of its own (its processes die with it; the trainer's are invisible)",
    "tmp": "private /tmp, /var/tmp, /dev/shm and /run/lock on one sized tmpfs (a mount namespace)",
    "user": "a uid of its own per run (the launcher runs as root)",
    "filesystem": "a filesystem view of its own (its own mount namespace, pivoted into a fresh root): the "
                  "interpreter's folders read-only and its run folder, nothing else of the host (no checkout, no data, "
                  "no /home, /root or /run)",
    "memory": "one memory limit for all of a run's processes together (a memory cgroup)",
}
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # always in the view
NAMESPACE_FLAGS = ("--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc")
UNPRIVILEGED_FLAGS = ("--user", "--map-root-user")
SANDBOX_UID_BASE = 300_000  # uids no account uses; a run takes one of its own
FIX = ("run the trainer as root (a container's root is enough), or enable unprivileged user namespaces "
       "(sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0) and install util-linux's "
       "`unshare`; or drop the feature from sandbox.require")


@dataclass(frozen=True)
class Isolation:
    """The isolation a run gets on this host; `unshare` is the command prefix ((), without namespaces).
    `view_dirs`: the interpreter's folders outside SYSTEM_DIRS that the filesystem view holds (None: no view)."""

    own_user: bool
    unshare: tuple[str, ...]
    python: str  # the interpreter the code runs in (readable by the run's uid)
    view_dirs: tuple[str, ...] | None = None
    memory: MemoryCgroups | None = None

    @property
    def namespaces(self) -> bool:
        return bool(self.unshare)

    @property
    def features(self) -> set[str]:
        return (({"network", "pid", "tmp"} if self.namespaces else set()) | ({"user"} if self.own_user else set())
                | ({"filesystem"} if self.view_dirs is not None else set()) | ({"memory"} if self.memory else set()))

    def describe(self) -> str:
        given = [FEATURES[f] for f in FEATURES if f in self.features]
        missing = [f for f in FEATURES if f not in self.features]
        text = "sandbox: resource limits, a private folder, an empty environment" + "".join(f", {g}" for g in given)
        if not self.memory:
            text += ("; memory is limited per process, so a run may hold memory_mb x max_processes (a memfd or "
                     "tmpfs file it has not mapped counts toward none of them)")
        return text + (f"; not on this host: {', '.join(missing)}" if missing else "") + f"; code runs in {self.python}"

    def require(self, wanted: Iterable[str], where: str = "sandbox.require") -> None:
        """Raise SandboxError naming the fix when a demanded feature is not available on this host."""
        wanted = list(wanted)
        unknown = [w for w in wanted if w not in FEATURES]
        if unknown:
            raise SandboxError(f"{where}: unknown isolation feature(s) {unknown}; choose from {sorted(FEATURES)}.")
        missing = [w for w in wanted if w not in self.features]
        if missing:
            raise SandboxError(f"{where} asks for {', '.join(FEATURES[m] for m in missing)}, which this host does "
                               f"not give ({self.describe()}). Fix: {FIX}.")


# Set once from the run's `sandbox` config section (verl.trainer.checks.startup); run_code's own arguments win.
DEFAULTS: dict[str, Any] = {"python": None, "require": ()}


def configure(*, python: str | None = None, require: Iterable[str] = ()) -> Isolation:
    """Make `python` and `require` the defaults of every run_code of this process; returns the isolation they
    give, refusing (SandboxError, with the fix) when this host cannot give what `require` asks."""
    found = isolation(python)
    found.require(require, "sandbox.require")
    DEFAULTS.update(python=python, require=tuple(require))
    return found


def _works(cmd: list[str], uid: int | None = None) -> bool:
    def drop() -> None:  # the probe runs as the sandbox would: under an unprivileged uid
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)

    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=10, env={},
                              preexec_fn=None if uid is None else drop)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _view_dirs(python: str) -> tuple[str, ...]:
    """The interpreter's own folders (its prefix) that SYSTEM_DIRS do not hold, e.g. a pyenv's."""
    done = subprocess.run([python, "-I", "-S", "-c", "import sys, json; print(json.dumps([sys.base_prefix, "
                           "sys.base_exec_prefix]))"], capture_output=True, text=True, timeout=10, env={})
    dirs = [os.path.realpath(d) for d in json.loads(done.stdout)]
    return tuple(dict.fromkeys(d for d in dirs if not any(d == s or d.startswith(s + "/") for s in SYSTEM_DIRS)))


def _runs(iso: Isolation, uid: int | None) -> bool:
    """Whether a program runs under `iso` and prints what it should: the probe of a filesystem view."""
    spec = run_spec(python=iso.python, uid=uid, files={"main.py": "import json, re, collections\nprint('ok')"},
                    view_dirs=iso.view_dirs, namespaces=iso.namespaces, cgroup=None, tmp="/tmp", cpu_s=10,
                    memory_mb=512, max_processes=8, max_open_files=64, max_file_mb=1, max_disk_mb=8)
    proc, status = start(iso.unshare, spec)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False
    finally:
        os.close(status)
    return proc.returncode == 0 and out == b"ok\n"


def _interpreter(candidates: Iterable[str], uid: int | None) -> str | None:
    """The first interpreter that starts, imports the standard library and runs as `uid`."""
    for path in dict.fromkeys(c for c in candidates if c and os.path.exists(c)):
        if _works([path, "-I", "-S", "-c", "import json, re, collections"], uid):
            return path
    return None


@functools.lru_cache(maxsize=4)
def isolation(python: str | None = None, namespaces: bool = True) -> Isolation:
    """This host's isolation (probed once; `python` names the interpreter for the code, None = this one or
    the system's). `namespaces=False` leaves namespaces out (the fallback every POSIX host has)."""
    if os.name != "posix":
        raise SandboxError("verl.sandbox needs a POSIX host (Linux or macOS) for resource limits and process "
                           "groups; run code rewards and the python tool on Linux.")
    root = os.geteuid() == 0
    probe_uid = SANDBOX_UID_BASE if root else None
    found = _interpreter([python] if python else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"],
                         probe_uid)
    if found is None:
        raise SandboxError(
            f"no Python interpreter {'at ' + python if python else 'here'} runs as an unprivileged uid "
            f"({'uid ' + str(probe_uid) if root else 'this user'}): its files must be readable by others "
            "(a pyenv under /root is not). Fix: set sandbox.python to one that is, e.g. /usr/bin/python3.")
    unshare = shutil.which("unshare") if namespaces and sys.platform.startswith("linux") else None
    prefix: tuple[str, ...] = ()
    if unshare:
        flags = NAMESPACE_FLAGS if root else UNPRIVILEGED_FLAGS + NAMESPACE_FLAGS
        if _works([unshare, *flags, "true"]):
            prefix = (unshare, *flags)
            setpriv = shutil.which("setpriv")  # unshare dies with the launcher, and --kill-child takes the run
            if setpriv and _works([setpriv, "--pdeathsig", "KILL", "true"]):
                prefix = (setpriv, "--pdeathsig", "KILL", *prefix)
    memory = memory_cgroups() if sys.platform.startswith("linux") else None
    plain = Isolation(own_user=root, unshare=prefix, python=found, memory=memory)
    if not prefix:
        return plain
    viewed = Isolation(own_user=root, unshare=prefix, python=found, view_dirs=_view_dirs(found), memory=memory)
    return viewed if _runs(viewed, probe_uid) else plain


__all__ = ["DEFAULTS", "FEATURES", "Isolation", "configure", "isolation"]
