"""The first process of a sandbox run (run as a script, standard library only; not imported by verl).

It starts with the launcher's privileges, inside the namespaces `unshare` made when the host has them (where
it is PID 1 of a PID namespace: when it exits, the kernel kills everything the code started), and dies with
its launcher (PR_SET_PDEATHSIG). It joins the run's memory cgroup when there is one, then builds what the code
sees: with a filesystem view, a fresh root (one sized tmpfs) holding the interpreter's folders read-only, a
few device nodes, its own /proc and the run folder, pivoted into so that nothing else of the host exists;
without one, a sized tmpfs over the host's world-writable folders (/tmp, /var/tmp, /dev/shm, /run/lock). It
writes the run's files into its folder, forks the child that runs the code (resource limits, its own uid when
the launcher is root, exec of the interpreter) and reports the child's fate on the status pipe as one JSON
line, so a program's own exit code (even 137) is never mistaken for a signal.

argv[1] is the file descriptor of a pipe carrying the JSON spec written by verl.sandbox.runner.
"""

import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import sys
import tempfile
import time

WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # share the run's one sized tmpfs
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
WORK = "/work"  # the run folder, inside the filesystem view
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}  # syscall numbers
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
libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _enc(s):
    return None if s is None else s.encode()


def _mount(source, target, fstype=None, flags=0, options=None):
    _check(libc.mount(_enc(source), _enc(target), _enc(fstype), flags, _enc(options)), f"mount {target}")


def _tmpfs(path, size_mb):
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=1777")


def _bind(source, target, read_only=True):
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _share_writable(run_tmp):
    """/tmp is the run's tmpfs; /var/tmp, /dev/shm and /run/lock are folders of it (one size for them all)."""
    for path in WRITABLE[1:]:
        if os.path.isdir(path) and not os.path.islink(path):
            inner = os.path.join(run_tmp, "." + path.strip("/").replace("/", "-"))
            os.makedirs(inner, mode=0o1777, exist_ok=True)
            os.chmod(inner, 0o1777)
            _bind(inner, path, read_only=False)


def _filesystem_view(spec, new_root):
    """Mount a sized tmpfs at `new_root`, furnish it and pivot into it: afterwards, the host's files other
    than the interpreter's folders (read-only) do not exist for anything in this mount namespace."""
    _tmpfs(new_root, spec["max_disk_mb"])
    os.chmod(new_root, 0o755)
    for path in SYSTEM_DIRS + tuple(spec["filesystem"]):
        inside = new_root + path
        if os.path.lexists(inside):
            continue
        if os.path.islink(path):
            os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
            os.symlink(os.readlink(path), inside)
        elif os.path.isdir(path):
            os.makedirs(inside, mode=0o755)
            _bind(path, inside)
    for path in SYSTEM_FILES:
        if os.path.isfile(path):
            os.makedirs(os.path.dirname(new_root + path), mode=0o755, exist_ok=True)
            open(new_root + path, "w").close()
            _bind(path, new_root + path)
    os.makedirs(new_root + "/dev", mode=0o755)
    for name in DEVICES:
        open(f"{new_root}/dev/{name}", "w").close()
        _bind(f"/dev/{name}", f"{new_root}/dev/{name}", read_only=False)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{new_root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{new_root}/dev/fd")
    os.makedirs(new_root + "/var", mode=0o755)
    os.symlink("/run/lock", new_root + "/var/lock")
    for path in ("/proc", WORK, *WRITABLE):  # all on the root's tmpfs: one size for everything written
        os.makedirs(new_root + path, mode=0o755, exist_ok=True)
        os.chmod(new_root + path, 0o1777 if path in WRITABLE else 0o755)
    _mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV)
    os.chdir(new_root)
    _check(libc.syscall(PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount the host's root")
    os.chdir("/")
    return WORK


def _run_folder(spec):
    """Where the code runs: inside the filesystem view, behind the private tmpfs, or (no namespaces) a folder
    of the host's temp dir, removed at the end."""
    if spec["filesystem"] is not None:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        return _filesystem_view(spec, "/tmp")  # the new root hides the host's /tmp: nothing is made there
    if spec["private_tmp"]:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _tmpfs("/tmp", spec["max_disk_mb"])
        _share_writable("/tmp")
        return tempfile.mkdtemp(prefix="work-", dir="/tmp")
    return tempfile.mkdtemp(prefix="verl-sandbox-", dir=spec["tmp"])


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
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the first process, even if the kernel skips it
    uid = spec["uid"]
    if uid is not None:  # the launcher is root: a uid of this run's own, so nothing of the host is its own
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _limits(spec)  # after setuid: RLIMIT_NPROC then counts this run's uid only
    os.execve(spec["python"], [spec["python"], "-I", "-S", "-B", "-u", "-c", LOADER % {"main": spec["main"]}],
              spec["env"])


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


def _remove(path):
    def unlock(fn, p, _exc):  # the program may have taken its own permissions away
        os.chmod(os.path.dirname(p), 0o700)
        os.chmod(p, 0o700) if os.path.isdir(p) else None
        fn(p)

    shutil.rmtree(path, onerror=unlock)


def _read_spec(fd):
    with os.fdopen(fd, "rb") as f:
        spec = json.loads(f.read())
    spec["files"] = {name: (bytes(c["latin1"], "latin-1") if isinstance(c, dict) else c)
                     for name, c in spec["files"].items()}
    return spec


def _setup(spec):
    """Everything before the code's process starts; returns the run folder."""
    if spec["cgroup"]:  # "0": this process; what it forks is born inside
        with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
            f.write("0")
    work = _run_folder(spec)
    for name, content in spec["files"].items():
        path = os.path.join(work, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())
    if spec["uid"] is not None:
        for folder, dirs, names in os.walk(work):
            for name in [folder, *(os.path.join(folder, n) for n in dirs + names)]:
                os.chown(name, spec["uid"], spec["uid"])
        os.chmod(work, 0o700)
    os.chdir(work)
    if not spec["pid_namespace"]:  # orphans of the program come here (to be killed and reaped), not to init
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    return work


def main():
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the run dies with its launcher
    if os.getppid() == 1 and os.getpid() != 1:  # the launcher died before the line above
        return 1
    spec = _read_spec(int(sys.argv[1]))
    status = os.fdopen(spec["status_fd"], "w")
    work = None
    try:
        work = _setup(spec)
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
        os.chdir("/")
        _remove(work)
    fate = {"signal": os.WTERMSIG(code)} if os.WIFSIGNALED(code) else {"exit": os.WEXITSTATUS(code)}
    status.write(json.dumps(fate) + "\n")
    status.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
