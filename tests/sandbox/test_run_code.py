"""verl.sandbox.run_code against real hostile programs: each is contained within its limits, the test process
(the trainer's stand-in) lives on, and nothing is left behind: no process of the run's uid, no folder.

Every test runs with the namespaces this host gives and, where it matters, without them (the fallback every
POSIX host has); a feature this host lacks is skipped with the reason."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from verl.errors import SandboxError
from verl.sandbox import Isolation, isolation, run_code
from verl.sandbox.isolation import SANDBOX_UID_BASE

HOST = isolation()
BOTH = pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no-namespaces"])


def live_processes_of_this_worker() -> list[str]:
    """Live (not zombie) processes under the uids this process gives its runs."""
    low = SANDBOX_UID_BASE + 1 + (os.getpid() % 500) * 200
    found = []
    for entry in os.listdir("/proc"):
        try:
            owner = os.stat(f"/proc/{entry}").st_uid
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if entry.isdigit() and low <= owner < low + 200 and state != "Z":
            found.append(entry)
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind(tmp_path, monkeypatch):
    """Every run's folder goes in a temp dir of this test's own, which must end empty."""
    folders = tmp_path / "sandboxes"
    folders.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folders))
    yield
    assert list(folders.iterdir()) == []
    if HOST.own_user:
        deadline = time.monotonic() + 2  # SIGKILLed processes take a moment to be gone
        while live_processes_of_this_worker() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_processes_of_this_worker() == []


def test_plain_program_reads_stdin_and_writes_stdout():
    result = run_code("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", "1 2 3\n4")
    assert (result.status, result.returncode, result.stdout, result.reason) == ("ok", 0, "10\n", "")
    assert result.ok


def test_an_exception_is_an_error_with_its_last_line_as_the_reason():
    result = run_code("def f():\n    raise ValueError('no answer')\nf()")
    assert (result.status, result.returncode) == ("error", 1)
    assert result.reason == "ValueError: no answer"
    assert 'File "main.py", line 2' in result.stderr


@BOTH
def test_infinite_loop_is_killed_at_the_timeout(namespaces):
    start = time.monotonic()
    result = run_code("while True:\n    pass", timeout_s=1.5, namespaces=namespaces)
    assert result.status == "timeout" and "1.5 s" in result.reason
    assert time.monotonic() - start < 4


def test_cpu_time_limit_stops_a_busy_program_before_the_wall_clock():
    result = run_code("while True:\n    pass", timeout_s=10, cpu_s=1)
    assert result.status == "timeout" and "CPU time" in result.reason and result.duration_s < 5


@BOTH
def test_sleeping_past_the_timeout(namespaces):
    result = run_code("import time\ntime.sleep(60)", timeout_s=1, namespaces=namespaces)
    assert result.status == "timeout" and result.duration_s < 3


@BOTH
def test_fork_bomb_is_contained(namespaces):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_code(bomb, timeout_s=2, max_processes=8, namespaces=namespaces)
    assert result.status == "timeout" and result.duration_s < 5


@BOTH
def test_child_that_outlives_the_program_is_killed(namespaces):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
            "    os._exit(0)\nprint('parent done')")
    result = run_code(code, timeout_s=5, namespaces=namespaces)
    assert result.ok and result.stdout == "parent done\n" and result.duration_s < 3
    if not namespaces and not HOST.own_user:
        pytest.skip("without namespaces or a uid of its own, a child that leaves the group can outlive the run")
    # the fixture checks no process of the run's uid is alive


def test_memory_hog_fails_within_its_limit():
    result = run_code("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))", memory_mb=200)
    assert result.status == "memory" and "200 MB" in result.reason


def test_huge_output_is_capped_and_the_program_killed():
    result = run_code("while True:\n    print('x' * 10000)", max_output_bytes=50_000, timeout_s=10)
    assert result.status == "killed" and "50000 bytes to stdout" in result.reason
    assert len(result.stdout) == 50_000 and result.duration_s < 5


def test_a_file_larger_than_the_limit_cannot_be_written():
    result = run_code("open('big', 'wb').write(b'x' * (3 * 2**20))", max_file_mb=1)
    assert result.status == "error" and "File too large" in result.reason


@BOTH
def test_writing_outside_its_folder(namespaces, tmp_path):
    if not HOST.own_user:
        pytest.skip("without a uid of its own the program may write wherever this user may")
    run_dir = tmp_path / "run"  # as a trainer's run folder: the launcher's, not world-writable
    run_dir.mkdir(mode=0o755)
    targets = [run_dir / "checkpoint.pt", tmp_path / "x.txt", Path(__file__).with_name("pwned.py")]
    code = "\n".join(f"try:\n    open({str(p)!r}, 'w').write('pwned')\n"
                     "except OSError as e:\n    print(type(e).__name__)"
                     for p in targets)
    result = run_code(code + "\nopen('mine.txt', 'w').write('fine')\nprint('done')", namespaces=namespaces)
    # Not writable, or (a folder under /tmp, as a clone in /tmp is) not even there with a private /tmp.
    errors = result.stdout.split()
    assert result.ok and errors[-1] == "done" and len(errors) == len(targets) + 1
    assert set(errors[:-1]) <= ({"PermissionError", "FileNotFoundError"} if namespaces else {"PermissionError"})
    assert not any(p.exists() for p in targets)


@pytest.mark.skipif("tmp" not in HOST.features, reason="this host gives no private /tmp (no mount namespace)")
def test_writes_to_tmp_stay_in_the_run(tmp_path):
    name = f"/tmp/verl-sandbox-test-{os.getpid()}"
    result = run_code(f"open({name!r}, 'w').write('x')\nprint(open({name!r}).read())")
    assert result.ok and result.stdout == "x\n" and not os.path.exists(name)


@BOTH
def test_the_trainers_secrets_are_not_readable(namespaces, monkeypatch):
    monkeypatch.setenv("VERL_TEST_SECRET", "hunter2-secret")
    code = ("import os\nprint(dict(os.environ))\nfor p in os.listdir('/proc'):\n    try:\n"
            "        print(open(f'/proc/{p}/environ', 'rb').read())\n    except OSError:\n        pass")
    result = run_code(code, namespaces=namespaces)
    assert result.ok and "hunter2-secret" not in result.stdout
    assert "VERL_TEST_SECRET" not in result.stdout


@pytest.mark.skipif("network" not in HOST.features, reason="this host gives no network namespace")
def test_no_network():
    with socket.socket() as server:  # a port on this host the program would reach without a namespace
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_code(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
    assert result.status == "error" and "in" not in result.stdout
    assert "unreachable" in result.reason or "refused" in result.reason


@BOTH
def test_killing_its_parent_or_the_trainer_fails(namespaces):
    if not namespaces and not HOST.own_user:
        pytest.skip("without namespaces or a uid of its own, the program may signal this user's processes")
    code = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}):\n    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(type(e).__name__)")
    result = run_code(code, namespaces=namespaces)
    assert result.ok and len(result.stdout.split()) == 2  # both refused; and this test is still running


def test_killing_its_own_group_is_reported_as_killed():
    result = run_code("import os, signal\nos.killpg(0, signal.SIGKILL)")
    assert result.status == "killed"


def test_64_concurrent_runs_finish_within_their_timeouts():
    start = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: run_code(f"print({i} * {i})", timeout_s=30), range(64)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(64)]
    assert all(r.ok for r in results) and time.monotonic() - start < 30


def test_files_are_written_into_the_folder_first():
    result = run_code("print(open('data/in.txt').read())", files={"data/in.txt": "hello"})
    assert result.stdout == "hello\n"
    with pytest.raises(SandboxError, match="relative path inside"):
        run_code("pass", files={"../escape.txt": "x"})


def test_bad_limits_and_missing_isolation_raise_with_the_fix():
    with pytest.raises(SandboxError, match="timeout_s=0"):
        run_code("pass", timeout_s=0)
    bare = Isolation(own_user=False, unshare=(), python="/usr/bin/python3")
    with pytest.raises(SandboxError, match="no network.*Fix: run the trainer as root"):
        bare.require(["network"])
    with pytest.raises(SandboxError, match="unknown isolation feature"):
        bare.require(["gpu"])
    assert "not on this host: network, pid, tmp, user" in bare.describe()
