"""SFT and DPO on 2 gloo processes: the policy is FSDP2-sharded like the RL actor and the run completes
with a verified checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from verl.checkpoint import verify

pytestmark = pytest.mark.dist

ROWS = {
    "sft": [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(4) for b in range(3)],
    "preference": [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
                   for a in range(4) for b in range(3)],
}


@pytest.mark.parametrize("kind,data_kind", [("sft", "sft"), ("dpo", "preference")])
def test_two_ranks(tmp_path, kind, data_kind):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[data_kind]))
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "data": {"kind": data_kind, "train_files": [str(data)], "train_batch_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8},
        "sft": {"batch_size": 4, "lr": 1e-3},
        "dpo": {"lr": 1e-3},
        "actor": {"micro_batch_size": 2},
        "trainer": {"kind": kind, "total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "verl.cli.main", "train", str(path)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert verify(tmp_path / "run" / "checkpoints" / "step_2") == []
