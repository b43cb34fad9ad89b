"""Skipping zero-advantage groups, token-budget micro-batches and shared-prompt forwards (actor, LoRA
actor with its adapters-off reference, critic) on 2 FSDP ranks: rank 0's groups all have equal rewards (it skips
everything) while rank 1 skips nothing, so the ranks have different numbers of micro-batches to run. Each still runs the
same forward/backward collectives (no hang), and the gradient equals the run that skips nothing."""

import pytest
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

pytestmark = pytest.mark.dist

REWARD = """
import os

def rank_dependent(prompt, response, ground_truth, **meta):
    if os.environ.get("RANK") == "0":
        return 1.0  # every group of rank 0 has equal rewards: zero advantage
    return sum(map(ord, response)) % 7 / 7  # differs between samples
"""


def _config(tmp_path, name, critic=None, algorithm=None, lora=None, **actor):
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = {
        "model": {"path": "tiny", "dtype": "float32", **({"lora": lora} if lora else {})},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "reward": {"functions": [{"name": f"{tmp_path / 'reward.py'}:rank_dependent"}]},
        "actor": {"lr": 1e-3, "micro_batch_size": 1, "grad_clip": 1000.0, **actor},
        "critic": {"lr": 1e-3, "grad_clip": 1000.0, **(critic or {})},
        "algorithm": algorithm or {},
        "devices": {"timeout_s": 120},
        "trainer": {"total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / name),
                    "val_before_train": False, "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_ranks_skipping_different_amounts_stay_in_step_with_the_same_gradient(tmp_path):
    verl_train(_config(tmp_path, "skip", max_tokens_per_micro_batch=24), tmp_path, nproc=2)
    verl_train(_config(tmp_path, "full", skip_zero_advantage=False, share_prompt_forward=False), tmp_path, nproc=2)
    skip, full = metrics(tmp_path / "skip"), metrics(tmp_path / "full")
    assert [r["step"] for r in skip] == [1, 2]
    assert all(r["actor/skipped_frac"] >= 0.5 for r in skip)  # rank 0 skips all (1.0), rank 1 fewer
    assert all("actor/skipped_frac" not in r for r in full)
    first, plain = skip[0], full[0]  # step 1 starts from the same weights and samples
    assert first["reward/mean"] == plain["reward/mean"]
    assert first["actor/grad_norm"] > 0
    assert first["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-5)


def _shared_and_plain_actor_step(tmp_path, **common):
    """Step 1's metrics of two 2-rank runs, with and without the shared-prompt forward; checks they agree."""
    verl_train(_config(tmp_path, "shared", share_prompt_forward=True, **common), tmp_path, nproc=2)
    verl_train(_config(tmp_path, "plain", share_prompt_forward=False, **common), tmp_path, nproc=2)
    shared, plain = metrics(tmp_path / "shared")[0], metrics(tmp_path / "plain")[0]
    assert shared["reward/mean"] == plain["reward/mean"]
    assert shared["actor/grad_norm"] > 0
    assert shared["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-5)
    assert shared["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-5, abs=1e-7)
    return shared, plain


def test_shared_prompt_actor_and_critic_on_two_ranks_give_the_unshared_gradients(tmp_path):
    """GAE with a critic: the policy and the critic each with and without the shared-prompt forward."""
    # unwhitened advantages: with whitened ones pg_loss is float32 noise around 0 (~1e-7), a comparison of rounding
    common = {"algorithm": {"adv_estimator": "gae", "whiten_advantages": False}, "micro_batch_size": 2,
              "entropy_coef": 0.01}  # a group per mb
    critic = {"micro_batch_size": 2, "warmup_steps_critic_only": 1}
    verl_train(_config(tmp_path, "shared", critic={"share_prompt_forward": True, **critic},
                       share_prompt_forward=True, **common), tmp_path, nproc=2)
    verl_train(_config(tmp_path, "plain", critic={"share_prompt_forward": False, **critic},
                       share_prompt_forward=False, **common), tmp_path, nproc=2)
    # Step 1 trains the critic alone: its value head starts at 0, so only the head has a gradient (the backbone's
    # is exactly 0 and Adam leaves it). Step 2 samples from the same untouched policy, sends the critic's gradient
    # through the backbone and the shared cache, and makes the policy's first update. (A policy update at step 1
    # would let Adam turn float32 rounding of near-zero gradients into lr-sized weight differences, which can
    # change step 2's samples; float64 is no way out: the critic's value head stays float32, FSDP2 refuses it.)
    rows = list(zip(metrics(tmp_path / "shared"), metrics(tmp_path / "plain"), strict=True))
    assert [("actor/grad_norm" in shared, "critic/grad_norm" in shared) for shared, _ in rows] == [(False, True),
                                                                                                  (True, True)]
    for shared, plain in rows:
        assert shared["reward/mean"] == plain["reward/mean"]
        for role, loss in (("actor", "pg_loss"), ("critic", "vf_loss")):
            if f"{role}/grad_norm" not in shared:
                continue
            assert shared[f"{role}/grad_norm"] > 0
            assert shared[f"{role}/grad_norm"] == pytest.approx(plain[f"{role}/grad_norm"], rel=1e-5)
            assert shared[f"{role}/{loss}"] == pytest.approx(plain[f"{role}/{loss}"], rel=1e-5, abs=1e-7)


def test_shared_prompt_lora_policy_and_reference_on_two_ranks_give_the_unshared_gradient(tmp_path):
    shared, plain = _shared_and_plain_actor_step(tmp_path, micro_batch_size=2, entropy_coef=0.01, kl_loss_coef=0.1,
                                                 lora={"rank": 4})
    assert shared["actor/kl_loss"] == pytest.approx(plain["actor/kl_loss"], abs=1e-7)  # adapters start at B = 0
