"""What isolation this host can give a sandbox run, found once per process.

Always (POSIX): resource limits, a process group killed as a whole, an empty environment and a private
working folder. Where the launcher is root, each run also gets a uid of its own (nothing of the host is its
own, RLIMIT_NPROC counts only its processes, it cannot signal the trainer). Where util-linux `unshare` can
make namespaces (root, or unprivileged user namespaces), the run also gets no network, its own PID
namespace (its processes die with it; it cannot see the trainer's) and private /tmp, /var/tmp and /dev/shm.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from verl.errors import SandboxError

# What a user may demand (sandbox.require), and what provides it.
FEATURES = {
    "network": "no network (a network namespace of its own)",
    "pid": "a PID namespace of its own (its processes die with it; the trainer's are invisible)",
    "tmp": "private /tmp, /var/tmp and /dev/shm (a mount namespace)",
    "user": "a uid of its own per run (the launcher runs as root)",
}
NAMESPACE_FLAGS = ("--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc")
UNPRIVILEGED_FLAGS = ("--user", "--map-root-user")
SANDBOX_UID_BASE = 300_000  # uids no account uses; a run takes one of its own
FIX = ("run the trainer as root (a container's root is enough), or enable unprivileged user namespaces "
       "(sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0) and install util-linux's "
       "`unshare`; or drop the feature from sandbox.require")


@dataclass(frozen=True)
class Isolation:
    """The isolation a run gets on this host; `unshare` is the command prefix ((), without namespaces)."""

    own_user: bool
    unshare: tuple[str, ...]
    python: str  # the interpreter the code runs in (readable by the run's uid)

    @property
    def namespaces(self) -> bool:
        return bool(self.unshare)

    @property
    def features(self) -> set[str]:
        return ({"network", "pid", "tmp"} if self.namespaces else set()) | ({"user"} if self.own_user else set())

    def describe(self) -> str:
        given = [FEATURES[f] for f in FEATURES if f in self.features]
        missing = [f for f in FEATURES if f not in self.features]
        text = "sandbox: resource limits, a private folder, an empty environment" + "".join(f", {g}" for g in given)
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


# Set once from the run's `sandbox` config section (verl.trainer.startup); run_code's own arguments win.
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
    return Isolation(own_user=root, unshare=prefix, python=found)


__all__ = ["DEFAULTS", "FEATURES", "Isolation", "configure", "isolation"]
