"""`verl train CONFIG model.lora.rank=8` as a user runs it, for RL (arithmetic environment), DPO and SFT; then
`verl ckpt verify` and `verl ckpt export` (merged and --adapter) on the run's last checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from verl.checkpoint import list_checkpoints
from verl.cli.main import main

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

ROWS = {
    "sft": [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(4) for b in range(3)],
    "preference": [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
                   for a in range(4) for b in range(3)],
}


def verl(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "verl.cli.main", *args], capture_output=True, text=True, timeout=600,
                         env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.parametrize("kind", ["rl", "dpo", "sft"])
def test_train_with_lora_from_the_command_line(tmp_path, kind):
    cfg = {"model": {"path": "tiny", "dtype": "float32"},
           "trainer": {"kind": kind, "total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / "run"),
                       "val_before_train": False, "cpu_threads": 1},
           "logging": {"backends": ["jsonl"]}, "actor": {"micro_batch_size": 4}}
    if kind == "rl":
        cfg |= {"env": {"name": "arithmetic", "kwargs": {"num_val": 4}}, "rollout": {"n": 2, "max_new_tokens": 4},
                "data": {"train_batch_size": 2}}
        cfg["actor"]["kl_loss_coef"] = 0.01
    else:
        data_kind = "sft" if kind == "sft" else "preference"
        (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[data_kind]))
        cfg["data"] = {"kind": data_kind, "train_files": ["train.jsonl"], "train_batch_size": 4,
                       "max_prompt_length": 16, "max_response_length": 8}
        cfg["sft"] = {"batch_size": 4}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    verl("train", "cfg.yaml", "model.lora.rank=8", cwd=tmp_path)
    step = list_checkpoints(tmp_path / "run")[-1]
    assert step.step == 2 and step.verified
    assert (step.path / "hf" / "adapter_config.json").is_file()
    # the same commands in this process (the training run above is the user's subprocess; three more process
    # starts would test nothing more)
    assert main(["ckpt", "verify", str(step.path)]) == 0
    assert main(["ckpt", "export", str(step.path), "--out", str(tmp_path / "merged")]) == 0
    assert main(["ckpt", "export", str(step.path), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
