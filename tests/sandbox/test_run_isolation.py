"""What a hostile program tried against the host, each contained: it sees only the interpreter and its folder
(not the checkout, the data, /root, /home or the host's /run/lock), its processes share one memory limit
(forks and memfd included), its writes share one sized tmpfs, and it dies with its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from verl.sandbox import isolation, run_code
from verl.sandbox.isolation import SANDBOX_UID_BASE

HOST = isolation()
needs = {f: pytest.mark.skipif(f not in HOST.features, reason=f"this host gives no {f} isolation")
         for f in ("filesystem", "memory", "tmp", "pid", "user")}
CHECKOUT = Path(__file__).resolve().parents[2]


def probe_paths(paths: list[str]) -> str:
    """A program printing, per path, whether it could read it (or list it)."""
    return textwrap.dedent(f"""
        import os
        for p in {paths!r}:
            try:
                print(p, 'listed' if os.path.isdir(p) and os.listdir(p) else 'read' if open(p).read(1) else 'empty')
            except OSError as e:
                print(p, type(e).__name__)
        """)


@needs["filesystem"]
def test_the_program_sees_neither_the_checkout_nor_the_data(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "2+2", "answer": "4"}\n')
    data.chmod(0o644)
    tmp_path.chmod(0o755)
    secret_paths = [str(CHECKOUT / "pyproject.toml"), str(data), "/root", "/home", "/run", "/etc/passwd",
                    "/etc/hostname", "/sys/class", os.path.expanduser("~"), str(CHECKOUT)]
    result = run_code(probe_paths(secret_paths), require=["filesystem"])
    assert result.ok, result.stderr
    lines = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    assert set(lines) == set(secret_paths)
    assert all(v in ("FileNotFoundError", "PermissionError") for p, v in lines.items() if p != "/run"), lines
    assert run_code("import os\nprint(os.listdir('/run'))").stdout == "['lock']\n"  # its own, empty /run/lock


@needs["filesystem"]
def test_the_interpreter_is_read_only_and_the_folder_is_its_own():
    code = textwrap.dedent("""
        import os, sys
        for p in ('/usr/lib/verl-pwned', sys.executable + '-pwned', '/verl-pwned', '/etc/verl-pwned'):
            try:
                open(p, 'w').write('x')
                print('wrote', p)
            except OSError as e:
                print(type(e).__name__)
        open('answer.txt', 'w').write('mine')
        import json, collections, re
        print(os.getcwd(), open('answer.txt').read())
        """)
    result = run_code(code)
    lines = result.stdout.split("\n")
    assert result.ok and not any(line.startswith("wrote") for line in lines), result.stdout
    assert lines[-2] == "/work mine"
    assert not os.path.exists("/usr/lib/verl-pwned")


@needs["tmp"]
def test_run_lock_is_private():
    name = f"verl-sandbox-lock-{os.getpid()}"
    for lock in ("/run/lock", "/var/lock"):
        result = run_code(f"import os\nopen(os.path.join({lock!r}, {name!r}), 'w').write('x')\nprint('ok')")
        assert result.ok and result.stdout == "ok\n", result.stderr
        assert not os.path.exists(os.path.join("/run/lock", name))


@needs["memory"]
def test_forked_children_share_one_memory_limit():
    code = textwrap.dedent("""
        import os, time
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                block = bytearray(150 * 2**20)  # zero pages, touched below
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(3)
                os._exit(0)
            pids.append(pid)
        codes = [os.waitpid(p, 0)[1] for p in pids]
        raise SystemExit(0 if all(c == 0 for c in codes) else 3)
        """)
    result = run_code(code, memory_mb=300, timeout_s=20)
    assert result.status == "memory" and "together went past its 300 MB" in result.reason, result
    assert result.peak_memory_mb is not None and result.peak_memory_mb <= 301


@needs["memory"]
def test_memfd_counts_toward_the_memory_limit():
    code = textwrap.dedent("""
        import os
        fds = []
        for i in range(40):  # 40 x 15 MB: each under max_file_mb, never mapped, so no RLIMIT_AS sees them
            fd = os.memfd_create(f'f{i}')
            os.write(fd, b'x' * (15 * 2**20))
            fds.append(fd)
        print('held 600 MB')
        """)
    result = run_code(code, memory_mb=256, max_file_mb=16, timeout_s=20)
    assert result.status == "memory" and "held" not in result.stdout, result


@needs["tmp"]
def test_what_it_writes_shares_one_sized_tmpfs():
    code = textwrap.dedent("""
        import os
        written = 0
        for folder in ('.', '/tmp', '/dev/shm'):
            for i in range(40):
                try:
                    with open(os.path.join(folder, f'blob{i}'), 'wb') as f:
                        f.write(b'x' * 2**20)
                    written += 1
                except OSError as e:
                    print(type(e).__name__, e.strerror)
                    break
        print('MB', written)
        """)
    result = run_code(code, max_disk_mb=32, max_file_mb=4, memory_mb=512)
    assert result.ok, result.stderr
    assert "No space left on device" in result.stdout
    assert int(result.stdout.split()[-1]) <= 32


@needs["user"]
@needs["pid"]
def test_the_run_dies_with_its_launcher():
    """The launcher (a trainer) is SIGKILLed while the program runs: the program goes with it."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", "from verl.sandbox import run_code\n"
         "run_code('import time\\nprint(1, flush=True)\\ntime.sleep(60)', timeout_s=50)"])
    uids = range(SANDBOX_UID_BASE + 1 + (launcher.pid % 500) * 200,
                 SANDBOX_UID_BASE + 1 + (launcher.pid % 500) * 200 + 200)

    def alive() -> list[int]:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if os.stat(f"/proc/{entry}").st_uid in uids and state != "Z":
                    found.append(int(entry))
            except (OSError, IndexError):
                continue
        return found

    deadline = time.monotonic() + 30
    while not alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(), "the program never started"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive() == []
