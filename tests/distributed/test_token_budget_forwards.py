"""A token budget (`*.max_tokens_per_micro_batch`) with ranks whose prompts differ in length: the forward-only
passes (old log-probs, reference, critic values) split each rank's rows into a different number of
micro-batches, and each FSDP forward all-gathers, so every rank must run the same number of them (the largest,
the others padded with a forward whose result is dropped), as the update loop already did. Before, the ranks
waited in different collectives until devices.timeout_s."""

import json

import pytest
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

pytestmark = pytest.mark.dist


def _prompts(n: int) -> list[dict]:
    """Sums of 2 to 13 terms: "3+4=" up to "1+2+...+9+1+2+3+4=", so their lengths spread widely."""
    rows = []
    for i in range(n):
        terms = [(i + k) % 9 + 1 for k in range(2 + i % 12)]
        rows.append({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms))})
    return rows


def test_ppo_with_a_reference_and_a_critic_on_two_ranks_with_a_token_budget_finishes(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _prompts(48)))
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "data": {"train_files": [str(data)], "train_batch_size": 8, "max_prompt_length": 40, "shuffle": False},
        "rollout": {"n": 2, "max_new_tokens": 4},
        "reward": {"functions": [{"name": "numeric_match"}]},
        "algorithm": {"adv_estimator": "gae"},
        "actor": {"lr": 1e-4, "micro_batch_size": 4, "max_tokens_per_micro_batch": 48,
                  "kl_loss_coef": 0.01},
        "critic": {"lr": 1e-4, "micro_batch_size": 4, "max_tokens_per_micro_batch": 48},
        "devices": {"timeout_s": 60},
        "trainer": {"total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / "run"), "val_before_train": False,
                    "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=2)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 and "critic/vf_loss" in r for r in rows), rows
