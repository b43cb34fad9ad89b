"""benchmarks/gpu_check.sh is valid bash, its parts' time limits fit 8 minutes, its final table has a row
for every part (each gpu test, from the junit XML or from a cut-off verbose log; every figure), and the
--smoke path runs end to end on CPU (tiny shapes)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check_table import BUDGET_S, build_rows, main, render  # noqa: E402


def test_gpu_check_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_parts_time_limits_sum_under_8_minutes():
    text = SCRIPT.read_text()
    limits = {k: int(v) for k, v in re.findall(r"\b(T_[A-Z]+)=(\d+)", text)}
    assert set(limits) == {"T_WHEELS", "T_ENV", "T_TESTS", "T_BENCH"}
    used = set(re.findall(r"timeout \$(T_[A-Z]+)", text))
    assert used == set(limits)  # every part on the GPU runs under its own limit
    assert sum(limits.values()) + 10 <= BUDGET_S == 480  # 10 s for start-up and the table


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.gpu.test_gpu_training" name="test_weights_move[default]" time="21.5"/>
<testcase classname="tests.gpu.test_gpu_training" name="test_weights_move[bf16-masters]" time="20.1">
  <failure message="AssertionError: 40.00% of the bf16 weights changed&#10;more">trace</failure></testcase>
<testcase classname="tests.gpu.test_gpu_training" name="test_two_gpus" time="0.0">
  <skipped type="pytest.skip" message="needs 2 CUDA GPUs">skip</skipped></testcase>
<testcase classname="tests.gpu.test_gpu_vllm" name="test_vllm" time="3.0"><error message="boom"/></testcase>
</testsuite></testsuites>"""

BENCH = {"rollout": {"ours_tokens_per_s": 30000.0, "hf_tokens_per_s": 9000.0, "speedup_vs_hf": 3.33},
         "grpo": {"steps": 6, "update_mfu": 0.31, "update_tflops": 306.7, "peak_gpu_memory_gib": 41.25,
                  "worst_step_over_stage_sum": 1.05},
         "targets": {"sampler_speedup_ge_3x": True, "update_mfu_ge_35pct": False, "step_le_1_2x_stage_sum": True}}


def _table(out: Path, **rcs) -> dict[str, tuple[str, str]]:
    return {r.part: (r.status, r.detail) for r in build_rows(out, rcs, elapsed=431)}


def test_the_table_has_every_test_and_every_figure_with_its_status(tmp_path):
    (tmp_path / "env.txt").write_text("torch 2.13 cuda 12.8 available True\ndevice 1 x NVIDIA H200 140 GiB\nverl ok\n")
    (tmp_path / "pytest_gpu.xml").write_text(JUNIT)
    (tmp_path / "gpu_check.json").write_text(json.dumps(BENCH))
    rows = _table(tmp_path, wheels=0, env=0, pytest=1, bench=0)
    assert rows["env"] == ("pass", "torch 2.13 cuda 12.8 available True | device 1 x NVIDIA H200 140 GiB | verl ok")
    assert rows["wheels (.whl)"] == ("pass", "installed")
    assert rows["gpu test test_gpu_training::test_weights_move[default]"] == ("pass", "21.5s")
    assert rows["gpu test test_gpu_training::test_weights_move[bf16-masters]"] == (
        "fail", "AssertionError: 40.00% of the bf16 weights changed")
    assert rows["gpu test test_gpu_training::test_two_gpus"] == ("skip", "needs 2 CUDA GPUs")
    assert rows["gpu test test_gpu_vllm::test_vllm"] == ("fail", "boom")
    assert rows["gpu tests (pytest -m gpu)"] == ("fail", "1 pass, 2 fail, 1 skip")
    assert rows["rollout tokens/s: ours vs HF generate"] == ("pass", "30000 vs 9000 (3.33x; target >= 3x on a GPU)")
    assert rows["update MFU"] == ("miss", "31.0% (306.70 TFLOPS; target >= 35% on a GPU)")
    assert rows["peak GPU memory"] == ("measured", "41.25 GiB (max allocated)")
    assert rows["step wall / stage sum"][0] == "pass"
    assert rows["benchmark (gpu_check.py)"] == ("pass", "exit status 0")
    assert rows["total time"] == ("pass", "431s (budget 480s)")


def test_parts_cut_off_by_their_time_limit_still_have_rows(tmp_path):
    """pytest killed by `timeout` writes no XML: the verbose log says what finished and what was running;
    a benchmark killed during GRPO keeps its rollout figures."""
    (tmp_path / "pytest_gpu.txt").write_text(
        "============ test session starts ============\n"
        "tests/gpu/test_gpu_sampler.py::test_greedy[fast-decode-qwen2-fp32] PASSED [  5%]\n"
        "tests/gpu/test_gpu_training.py::test_two_gpus SKIPPED (needs 2 CUDA GPUs) [ 10%]\n"
        "tests/gpu/test_gpu_training.py::test_cpu_offload FAILED                   [ 15%]\n"
        "tests/gpu/test_gpu_training.py::test_collective_guard_times_out_with_nccl ")
    (tmp_path / "gpu_check.json").write_text(json.dumps({"rollout": BENCH["rollout"]}))
    rows = _table(tmp_path, env=0, pytest=124, bench=124)
    assert rows["gpu test test_gpu_sampler::test_greedy[fast-decode-qwen2-fp32]"] == ("pass", "")
    assert rows["gpu test test_gpu_training::test_two_gpus"] == ("skip", "needs 2 CUDA GPUs")
    assert rows["gpu test test_gpu_training::test_cpu_offload"][0] == "fail"
    assert rows["gpu test test_gpu_training::test_collective_guard_times_out_with_nccl"][0] == "timeout"
    assert rows["gpu tests (pytest -m gpu)"] == ("timeout", "1 pass, 1 fail, 1 skip, 1 timeout")
    assert rows["rollout tokens/s: ours vs HF generate"][0] == "measured"  # no targets judged yet
    assert rows["update MFU"][0] == rows["peak GPU memory"][0] == "timeout"
    assert rows["benchmark (gpu_check.py)"][0] == "timeout"
    # an environment that failed: the parts after it did not run, and the table still prints them
    rows = _table(tmp_path / "nothing", env=1, pytest=None, bench=None)
    assert rows["env"] == ("fail", "no env.txt") and rows["gpu tests (pytest -m gpu)"][0] == "not run"
    assert rows["update MFU"][0] == "not run" and "wheels (.whl)" not in rows


def test_the_table_command_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--rc", "wheels=", "--rc", "env=0", "--rc", "pytest=0", "--rc", "bench="]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["part", "status", "detail"]
    assert any(line.startswith("wheels (.whl)") and " skip " in line for line in lines)
    assert render(build_rows(tmp_path, {"env": 0})).count("\n") == len(build_rows(tmp_path, {"env": 0})) + 1


def _gpu_test_functions() -> set[str]:
    names = set()
    for path in (ROOT / "tests" / "gpu").glob("test_*.py"):
        names |= {f"{path.stem}::{n}" for n in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    return names


@pytest.mark.slow
def test_gpu_check_smoke_prints_one_table_with_every_part(tmp_path):
    """`gpu_check.sh --smoke` on CPU: every gpu test skips itself, the benchmark runs on tiny shapes, and the
    last thing printed is the table: the environment, every gpu test, every figure, the total time."""
    env = {"PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"],
           "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/tmp")}
    done = subprocess.run(["bash", str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=900, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["rollout"]["ours_tokens_per_s"] > 0 and result["rollout"]["hf_tokens_per_s"] > 0
    assert result["grpo"]["steps"] == 2 and {"generate", "update"} <= set(result["grpo"]["seconds_per_stage"])
    assert result["targets"]["sampler_speedup_ge_3x"] is None  # GPU targets are not judged on CPU
    assert (tmp_path / "bench.txt").read_text().strip().splitlines()[-1].startswith("ratio: ours / HF generate")
    table = done.stdout[done.stdout.index("part "):].splitlines()
    parts = [line[:line.index("  ")] for line in table[2:]]
    for name in _gpu_test_functions():  # each one at least once (parametrized ones once per case)
        assert any(p == f"gpu test {name}" or p.startswith(f"gpu test {name}[") for p in parts), name
    assert all(" skip " in line for line in table[2:] if line.startswith("gpu test "))
    for part in ("env", "gpu tests (pytest -m gpu)", "rollout tokens/s: ours vs HF generate", "update MFU",
                 "peak GPU memory", "step wall / stage sum", "benchmark (gpu_check.py)", "total time"):
        assert part in parts, part
    assert table[-1].startswith("total time")
    assert (tmp_path / "summary.txt").read_text().rstrip().endswith(table[-1])
