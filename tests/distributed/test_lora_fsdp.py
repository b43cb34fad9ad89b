"""LoRA under FSDP2 (frozen base weights and trainable adapters in the same shards) on 2 gloo processes:
SFT, DPO (whose reference is the policy with its adapters off) and the reward model (adapters plus its score
head) give what 1 process gives, in float64: losses within 1e-5, adapters within 1e-9;
RL trains with the sampler, reference and update on the sharded peft model, and resumes on 1 process."""

import json

import pytest
import torch
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path
from safetensors.torch import load_file

from verl.checkpoint import export_hf, verify

pytestmark = pytest.mark.dist
peft = pytest.importorskip("peft")

ROWS = {
    "sft": [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(4) for b in range(3)],
    "preference": [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
                   for a in range(4) for b in range(3)],
}


def _offline_config(tmp_path, kind, data_kind, name):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[data_kind]))
    cfg = {
        # float64: 1 and 2 ranks sum in different orders, and Adam divides each gradient by its own size, so
        # float32 rounding of a near-zero gradient becomes an lr-sized (1e-2) adapter difference after the steps
        # (6e-6 of the 1e-5 allowed on one machine); in float64 the adapters agree to ~1e-15.
        "model": {"path": "tiny", "dtype": "float64", "lora": {"rank": 8}},
        "data": {"kind": data_kind, "train_files": [str(data)], "train_batch_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8},
        "sft": {"batch_size": 4, "lr": 1e-2},
        "dpo": {"lr": 1e-2},
        "rm": {"lr": 1e-2},
        "actor": {"micro_batch_size": 2},
        "trainer": {"kind": kind, "total_steps": 3, "device": "cpu", "run_dir": str(tmp_path / name),
                    "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("kind,data_kind", [("sft", "sft"),
                                            pytest.param("dpo", "preference", marks=pytest.mark.slow),
                                            pytest.param("rm", "preference", marks=pytest.mark.slow)])
def test_two_ranks_equal_one_rank(tmp_path, kind, data_kind):
    verl_train(_offline_config(tmp_path, kind, data_kind, "one"), tmp_path, nproc=1)
    verl_train(_offline_config(tmp_path, kind, data_kind, "two"), tmp_path, nproc=2)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in two if "loss" in r] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):  # the logged loss is the global batch's on every rank count
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    adapters = []
    for name in ("one", "two"):
        step = tmp_path / name / "checkpoints" / "step_3"
        assert verify(step) == []
        adapters.append(load_file(str(export_hf(step, tmp_path / f"{name}-adapter", adapter=True)
                                      / "adapter_model.safetensors")))
    # 28 LoRA matrices; the reward model's score head is saved with them (peft's modules_to_save)
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) == 28 + (kind == "rm")
    if kind == "rm":
        assert any(k.startswith("score.") or ".score." in k for k in adapters[0])
    assert any(v.abs().max() > 0 for k, v in adapters[0].items() if "lora_B" in k)  # the adapters moved
    for key, value in adapters[0].items():
        assert value.dtype == torch.float64 and torch.allclose(value, adapters[1][key], rtol=0, atol=1e-9), key


@pytest.mark.slow
def test_rl_with_lora_on_two_ranks_then_resumed_on_one(tmp_path):
    def config(steps):
        cfg = {
            "model": {"path": "tiny", "dtype": "float32", "lora": {"rank": 8}},
            "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 8}},
            "data": {"train_batch_size": 4, "max_prompt_length": 16},
            "rollout": {"n": 2, "max_new_tokens": 3},
            "actor": {"lr": 1e-2, "micro_batch_size": 2, "entropy_coef": 0.01, "kl_loss_coef": 0.1},
            "trainer": {"total_steps": steps, "device": "cpu", "run_dir": str(tmp_path / "run"),
                        "val_before_train": False, "cpu_threads": 1},
            "checkpoint": {"save_interval": 1},
            "logging": {"backends": ["jsonl"]},
        }
        path = tmp_path / f"rl{steps}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    verl_train(config(2), tmp_path, nproc=2)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in rows) and rows[1]["actor/ref_kl"] != 0
    assert verify(tmp_path / "run" / "checkpoints" / "step_2") == []
    verl_train(config(3), tmp_path)  # the 2-rank adapter checkpoint loads into 1 process
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.slow
def test_rl_with_lora_and_the_reference_on_ranks_of_its_own(tmp_path):
    """devices.ref apart from the actor: the reference rank runs its unsharded, never-updated copy of the
    policy with the adapters off (the base weights), so KL to the base model still anchors the actor."""
    cfg = {
        "model": {"path": "tiny", "dtype": "float32", "lora": {"rank": 8}},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 3},
        "actor": {"lr": 1e-2, "micro_batch_size": 2, "entropy_coef": 0.01, "kl_loss_coef": 0.1},
        "devices": {"actor": [0, 1], "ref": [2]},
        "trainer": {"total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False, "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=3)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/ref_kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0 at start: policy == base
    assert rows[1]["actor/ref_kl"] != 0.0 and "actor/kl_loss" in rows[1]
    assert verify(tmp_path / "run" / "checkpoints" / "step_2") == []
