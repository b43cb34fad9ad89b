"""benchmarks/gpu_check.sh is valid bash, and its Python part runs end to end on CPU (tiny shapes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--small",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["rollout"]["ours_tokens_per_s"] > 0 and result["rollout"]["hf_tokens_per_s"] > 0
    assert result["grpo"]["steps"] == 2 and {"generate", "update"} <= set(result["grpo"]["seconds_per_stage"])
    assert result["targets"]["sampler_speedup_ge_3x"] is None  # GPU targets are not judged on CPU
    assert done.stdout.strip().splitlines()[-1].startswith("ratio: ours / HF generate tokens/s = ")
