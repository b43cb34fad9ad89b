"""The first process of a sandbox run (run as a script, standard library only; not imported by verl).

It starts with the launcher's privileges, inside the namespaces `unshare` made when the host has them (where
it is PID 1 of a PID namespace: when it exits, the kernel kills everything the code started). It hides the
host's world-writable folders behind private tmpfs mounts, then forks the child that runs the code: resource
limits, its own uid when the launcher is root, the private working folder, and exec of the interpreter. It
reports the child's fate on the status pipe as one JSON line, so a program's own exit code (even 137) is
never mistaken for a signal.

argv[1] is the JSON spec written by verl.sandbox.runner.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")
MS_NOSUID, MS_NODEV = 2, 4
PR_SET_CHILD_SUBREAPER = 36
# Runs main.py as __main__; a traceback starts at the program's own frame, not this loader's.
LOADER = """import sys
sys.argv = [%(main)r]
try:
    exec(compile(open(%(main)r).read(), %(main)r, 'exec'), {'__name__': '__main__', '__file__': %(main)r})
except SystemExit:
    raise
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


def _mount_tmpfs(path, size_mb):
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"size={size_mb}m,mode=1777".encode()
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs on {path}")


def _limits(spec):
    mb = 1024 * 1024
    cpu = spec["cpu_s"]
    for name, value in (("RLIMIT_AS", spec["memory_mb"] * mb), ("RLIMIT_CPU", (cpu, cpu + 1)),
                        ("RLIMIT_NOFILE", spec["max_open_files"]), ("RLIMIT_FSIZE", spec["max_file_mb"] * mb),
                        ("RLIMIT_NPROC", spec["max_processes"]), ("RLIMIT_CORE", 0)):
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _child(spec):
    os.closerange(3, 1 << 16)
    uid = spec["uid"]
    if uid is not None:  # the launcher is root: a uid of this run's own, so nothing of the host is its own
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _limits(spec)  # after setuid: RLIMIT_NPROC then counts this run's uid only
    # The folder's path is hidden behind the private /tmp; only relative paths reach it (the cwd).
    os.execve(spec["python"], [spec["python"], "-I", "-S", "-B", "-u", "-c", LOADER % {"main": spec["main"]}], spec["env"])


def _stragglers(uid, pgid, keep):
    """Live processes of `uid` or of process group `pgid`, other than `keep` and this one."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), keep):
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            owner = os.stat(f"/proc/{entry}").st_uid
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and (owner == uid or int(fields[2]) == pgid):
            found.append(int(entry))
    return found


def kill_uid(uid):
    """SIGKILL every process of the run's own `uid` at once: kill(-1) sent as that uid. The kernel applies it
    atomically with respect to fork, so no process can fork past it (one can past a scan of /proc, which is
    how a grandchild forked during the sweep escaped it). Only a root launcher gives runs a uid of their own."""
    if uid is None or os.getuid() != 0 or uid == 0:
        return
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def sweep(uid, pgid, keep=None, reap=True):
    """Kill what a run left behind without a PID namespace (a child that outlived the program, one that left
    the process group: found by the run's own uid), and reap what was reparented here (`reap`: never in
    the trainer, whose other children are not ours to wait for)."""
    for _ in range(50):
        left = _stragglers(uid, pgid, keep)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while reap and os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not left:
            return
        time.sleep(0.01)


def main():
    spec = json.loads(sys.argv[1])
    status = os.fdopen(spec["status_fd"], "w")
    try:
        os.chdir(spec["workdir"])  # before the private /tmp hides the host's (the folder stays this one's cwd)
        if spec["private_tmp"]:
            for path in PRIVATE_TMP:
                if os.path.isdir(path):
                    _mount_tmpfs(path, spec["max_file_mb"])
        if not spec["pid_namespace"]:  # orphans of the program come here (to be killed and reaped), not to init
            ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
        pid = os.fork()
    except OSError as e:
        status.write(json.dumps({"setup_error": f"{type(e).__name__}: {e}"}) + "\n")
        status.close()
        return 0
    if pid == 0:
        try:
            _child(spec)
        except BaseException as e:  # noqa: BLE001 - reported through the exit code; stderr is the program's
            os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(126)
    # As PID 1, reap every orphan until the code's own process ends; its fate is the run's.
    while True:
        try:
            done, code = os.wait()
        except ChildProcessError:
            code = 0
            break
        if done == pid:
            break
    if not spec["pid_namespace"]:  # here, not in the trainer's timeout sweep: no fork of the trainer needed
        kill_uid(spec["uid"])
        sweep(spec["uid"], os.getpgid(0))
    fate = {"signal": os.WTERMSIG(code)} if os.WIFSIGNALED(code) else {"exit": os.WEXITSTATUS(code)}
    status.write(json.dumps(fate) + "\n")
    status.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
