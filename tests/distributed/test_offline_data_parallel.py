"""SFT, DPO and the reward model on 2 gloo processes: the trained model is FSDP2-sharded like the RL actor and
the run completes with a verified checkpoint (the reward model also with its exported Hugging Face folder)."""

import json

import pytest
import torch
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

from verl.checkpoint import verify

pytestmark = pytest.mark.dist

ROWS = {
    "sft": [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(4) for b in range(3)],
    "preference": [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
                   for a in range(4) for b in range(3)],
}


@pytest.mark.parametrize("kind,data_kind", [("sft", "sft"), ("dpo", "preference"), ("rm", "preference")])
def test_two_ranks(tmp_path, kind, data_kind):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[data_kind]))
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "data": {"kind": data_kind, "train_files": [str(data)], "train_batch_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8},
        "sft": {"batch_size": 4, "lr": 1e-3},
        "dpo": {"lr": 1e-3},
        "rm": {"lr": 1e-3},
        "actor": {"micro_batch_size": 2},
        "trainer": {"kind": kind, "total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=2)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert verify(tmp_path / "run" / "checkpoints" / "step_2") == []
    if kind == "rm":  # rank 0 exported the sharded checkpoint; it scores as a one-label classifier
        from verl.models.reward_model import RewardModelScorer

        scores = RewardModelScorer(str(tmp_path / "run" / "reward_model"))(["1+2=3", "1+2=4"])
        assert scores.shape == (2,) and bool(torch.isfinite(scores).all())


def _offline_config(tmp_path, kind, name, packing=False, **actor):
    data_kind = "sft" if kind == "sft" else "preference"
    data = tmp_path / f"{data_kind}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[data_kind]))
    cfg = {
        # float64: step 2 (and the validation after step 1) runs on weights after an Adam step, which divides each
        # gradient by its own size, so float32 rounding of a near-zero gradient, summed in another order on the
        # split ranks, would become an lr-sized weight difference. In float64 both steps agree to ~1e-8 (DPO's
        # margins, from its float32 log-prob sums, to 1e-6); in float32 step 1's DPO grad_norm was 4e-6 apart.
        "model": {"path": "tiny", "dtype": "float64"},
        "data": {"kind": data_kind, "train_files": [str(data)], "train_batch_size": 4, "val_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8},
        "sft": {"batch_size": 4, "lr": 1e-3, "packing": packing},
        "dpo": {"lr": 1e-3},
        "actor": {"micro_batch_size": 2, **actor},
        "trainer": {"kind": kind, "total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / name),
                    "cpu_threads": 1, "val_every": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind,nproc,packing", [("dpo", 2, False), ("sft", 4, True)])
def test_sequence_parallel_run_equals_one_process(tmp_path, kind, nproc, packing):
    """`verl train` with actor.sequence_parallel_size=2 against one process, the same loss, gradient norm and
    validation: DPO on 2 ranks (one group: both ranks read the whole batch, its padded rows packed into one
    and split over them), SFT's packed rows on 4 (two groups, data-parallel over them)."""
    runs = {}
    for name, n, size in (("one", 1, 1), ("split", nproc, 2)):
        verl_train(_offline_config(tmp_path, kind, name, packing, sequence_parallel_size=size), tmp_path, nproc=n)
        runs[name] = metrics(tmp_path / name)
    keys = (["loss", "grad_norm", "val/loss"]
            + (["accuracy", "rewards/margins", "val/accuracy"] if kind == "dpo" else []))
    for one, split in zip(runs["one"], runs["split"], strict=True):
        assert one["step"] == split["step"]
        for key in keys:
            if key in one:
                assert split[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), (one["step"], key)
    assert runs["one"][1]["grad_norm"] > 0 and len(runs["one"]) == 3  # validation before training, 2 steps
