"""One process under torchrun joins a process group and shards the policy with FSDP2, so
`fsdp.mixed_precision` (fp32 master weights, bf16 compute) and `fsdp.activation_checkpointing` take effect
on a single device. On CPU this runs over gloo; tests/gpu/test_gpu_training.py runs the same worker over NCCL."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from test_gpu_training import ROOT, WORKER, _rl_config  # noqa: E402

pytestmark = pytest.mark.dist


def test_one_rank_under_torchrun_shards_with_mixed_precision_and_checkpointing(tmp_path):
    cfg = _rl_config(tmp_path, model={"dtype": "float32"}, rollout={"n": 2, "max_new_tokens": 4},
                     data={"train_batch_size": 4}, actor={"micro_batch_size": 4},
                     trainer={"device": "cpu", "cpu_threads": 1},
                     fsdp={"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                           "activation_checkpointing": True})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          str(WORKER), "train", str(cfg)], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "fsdp_report.json").read_text())
    assert report == {"backend": "gloo", "fsdp": True, "param_dtypes": ["torch.float32"],
                      "compute_dtype": "torch.bfloat16", "checkpointed_layers": 2}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
