"""What `verl train` prints, run as a user runs it: piped to a file, under a terminal, and stopped with Ctrl-C.

Piped and SIGINT runs are subprocesses with stdout on a pipe; the terminal run gets a real pseudo-terminal
(Python's `pty`, 80x24) so rich sees a TTY of that size and draws its progress bar.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from verl.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """\
model: {{path: tiny, dtype: float32}}
env: {{name: arithmetic, kwargs: {{max_operand: 9, num_val: 8}}}}
data: {{train_batch_size: 4}}
rollout: {{n: 4, max_new_tokens: 4}}
actor: {{lr: 1.0e-3}}
checkpoint: {{save_interval: {save_interval}}}
trainer: {{total_steps: {steps}, device: cpu, val_before_train: false, val_every: 2, log_samples: 4, run_dir: {run_dir}}}
logging: {{backends: [console, jsonl]}}
"""  # noqa: E501 (a YAML config: its trainer line is one flow mapping)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _config(tmp_path: Path, steps: int, save_interval: int = 1) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(steps=steps, save_interval=save_interval, run_dir=run_dir), encoding="utf-8")
    return path, run_dir


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"COLUMNS", "LINES"}}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _train(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl.cli", "train", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_piped_output_banner_one_line_per_step_and_samples(tmp_path):
    cfg, run_dir = _config(tmp_path, steps=3)
    proc = _train(str(cfg), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    # the banner comes first: what is trained, on what, and where the run directory is
    assert lines[0] == "verl train: rl (grpo), 3 steps"
    assert re.fullmatch(r"model: tiny \(qwen2, [\d,]+ parameters\)", lines[1])
    assert re.fullmatch(r"data: [\d,]+ train rows, 8 validation rows", lines[2])
    assert lines[3] == f"run directory: {run_dir}"
    # the CPU kernel and why, so that a result can be reproduced on the same one
    assert re.fullmatch(r"linear layers on CPU: (ATen \(MKL\)|oneDNN) \(trainer.cpu_matmul=auto: .+\)", lines[4])
    assert lines[5] == "starting from scratch (no checkpoint to resume)"
    # one unwrapped line per logged step, with full metric names
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"]
    for line in steps:
        assert "  eta " in line and "reward/mean=" in line and "actor/pg_loss=" in line
        assert re.search(r"timing/step=[0-9.e+-]+s\b", line) and len(line) > 80  # longer than 80, not wrapped
    assert "val/accuracy=" in steps[1] and "\x1b[" not in proc.stdout
    # samples: 4 per validation (steps 2 and 3) in samples.jsonl, 3 of them on the console
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 4 + [3] * 4
    assert set(rows[0]) == {"step", "prompt", "response", "score", "ground_truth", "data_source"}
    assert rows[0]["score"] in (0.0, 1.0) and isinstance(rows[0]["prompt"], str)
    at = lines.index(f"validation samples at step 2 (3 of 4; all 4 in {run_dir / 'samples.jsonl'}):")
    assert all(line.startswith("  prompt=") for line in lines[at + 1:at + 4])
    assert json.dumps(rows[0]["prompt"]) in lines[at + 1]


@pytest.mark.slow
def test_resume_banner_shows_changed_keys_and_fresh_run_rotates_metrics(tmp_path):
    cfg, run_dir = _config(tmp_path, steps=2)
    assert _train(str(cfg), cwd=tmp_path).returncode == 0
    again = _train(str(cfg), "trainer.total_steps=3", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stdout.splitlines()
    assert f"resuming from {run_dir / 'checkpoints' / 'step_2'} (step 2/3)" in lines
    at = lines.index("config changed since that checkpoint:")
    assert lines[at + 1] == "  trainer.total_steps: 2 -> 3" and lines[at + 2].startswith("step 3/3")
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    # the same run directory from scratch: the old metrics are moved aside, not appended to
    fresh = _train(str(cfg), "trainer.resume=never", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "starting from scratch (trainer.resume=never)" in fresh.stdout
    assert "a fresh run in an existing run directory: moved the old metrics.jsonl to metrics.jsonl.1" in fresh.stdout
    old = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl.1").read_text().splitlines()]
    new = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert old == [1, 2, 3] and new == [1, 2]
    assert (run_dir / "samples.jsonl.1").is_file()


def test_sigint_saves_says_where_and_exits_130_then_the_same_command_resumes(tmp_path):
    cfg, run_dir = _config(tmp_path, steps=20, save_interval=0)
    proc = subprocess.Popen([sys.executable, "-m", "verl.cli", "train", str(cfg)], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            if line.startswith("step 1/20"):
                break
            assert time.monotonic() < deadline, "no step line"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    match = re.search(r"interrupted at step (\d+)/20 \(SIGINT\); saved (\S+); rerun the same command to resume", err)
    assert match, err[-3000:]
    stopped = int(match.group(1))
    assert 1 <= stopped < 20 and Path(match.group(2)) == run_dir / "checkpoints" / f"step_{stopped}"
    assert [c.step for c in list_checkpoints(run_dir)] == [stopped]
    assert "Traceback" not in err
    rerun = _train(str(cfg), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{stopped}'} (step {stopped}/20)" in rerun.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


def _run_in_terminal(argv: list[str], cwd: Path, columns: int = 80, rows: int = 24, timeout: float = 180) -> str:
    """Run `argv` with stdin/stdout/stderr on a pseudo-terminal of `columns` x `rows`; all it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, env={**_env(), "TERM": "xterm-256color"}, stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode("utf-8", errors="replace")


def test_terminal_shows_a_progress_bar_and_metrics_lines_that_fit_the_width(tmp_path):
    cfg, run_dir = _config(tmp_path, steps=4)
    raw = _run_in_terminal([sys.executable, "-m", "verl.cli", "train", str(cfg)], cwd=tmp_path)
    text = ANSI.sub("", raw)
    segments = [s for s in re.split(r"\r\n|\n|\r", text) if s.strip()]
    assert any(re.match(r"step 4/4 ━+ 100% eta 0:00:00", s) for s in segments), segments[-10:]  # the bar
    step_lines = [s for s in segments if re.match(r"step \d/4  eta ", s)]
    assert len(step_lines) == 4 and all("reward/mean=" in s for s in step_lines)
    fitted = [s for s in segments if s.startswith(("step ", "  prompt=", "verl train:", "model:", "data:"))]
    assert len(fitted) > 4 + 4 and all(len(s) <= 80 for s in fitted), [s for s in fitted if len(s) > 80]
    assert f"run directory: {run_dir}" in segments  # a path is printed whole (the terminal may wrap it)
    assert "\x1b[" in raw  # a terminal gets colour and cursor control; a pipe does not (test above)
