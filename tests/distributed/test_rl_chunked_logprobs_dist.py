"""GRPO through `verl train` on 2 gloo ranks (FSDP2 policy, sharded reference, KL loss, entropy bonus) with
`actor.chunked_logprobs` true and false: the same losses and gradient norms step for step."""

import pytest
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _config(tmp_path, chunked: bool):
    name = f"chunked_{str(chunked).lower()}"
    cfg = {
        # float64: step 2 runs on weights after an Adam step, which divides each gradient by its own size, so the
        # two paths' float32 rounding of near-zero gradients would become lr-sized weight differences; in float64
        # the runs agree to ~1e-15.
        "model": {"path": "tiny", "dtype": "float64"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 4},
        "actor": {"lr": 1e-3, "micro_batch_size": 2, "entropy_coef": 0.01, "kl_loss_coef": 0.1,
                  "chunked_logprobs": chunked},
        "trainer": {"total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / name), "val_before_train": False,
                    "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, tmp_path / name


def test_chunked_and_plain_log_probs_train_the_same_on_two_ranks(tmp_path):
    runs = []
    for chunked in (True, False):
        path, run_dir = _config(tmp_path, chunked)
        verl_train(path, tmp_path, nproc=2)
        runs.append(metrics(run_dir))
    chunked, plain = runs
    assert [r["step"] for r in chunked] == [r["step"] for r in plain] == [1, 2]
    for a, b in zip(chunked, plain, strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "reward/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-12), key
