"""`trainer.cpu_matmul` reaches every model a trainer builds (policy, reference, critic, reward model; DPO's),
and a training step is the same computation on either library."""

from __future__ import annotations

import pytest
import torch
from rl_support import rl_config

from verl.config.loader import build_config
from verl.trainer.offline.dpo_trainer import DPOTrainer
from verl.trainer.rl_trainer import RLTrainer
from verl.utils.cpu_matmul import OneDNNLinear, onednn_available

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


def _linear_classes(module: torch.nn.Module) -> set[type]:
    return {type(m) for m in module.modules() if isinstance(m, torch.nn.Linear)}


@needs_onednn
def test_policy_reference_and_critic_all_get_the_library(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path, "algorithm.adv_estimator=gae", "actor.kl_loss_coef=0.01",
                                  "trainer.cpu_matmul=onednn"))
    for module in (trainer.model, trainer.ref_model, trainer.critic):
        assert _linear_classes(module) == {OneDNNLinear}
    trainer = RLTrainer(rl_config(tmp_path / "aten", "actor.kl_loss_coef=0.01", "trainer.cpu_matmul=aten"))
    assert _linear_classes(trainer.model) == _linear_classes(trainer.ref_model) == {torch.nn.Linear}


@needs_onednn
def test_a_reward_model_and_the_dpo_and_sft_models_get_it_too(tmp_path):
    from verl.models.tiny import build_tiny_reward_model

    trainer = RLTrainer(rl_config(tmp_path, f"reward.model_path={build_tiny_reward_model()}",
                                  "trainer.cpu_matmul=onednn", reward={"name": "numeric_match"}))
    scorer = next(ld.fn for ld in trainer.env.reward_manager._loaded if ld.label == "reward_model").scorer
    assert _linear_classes(scorer.model) == {OneDNNLinear}
    pairs = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(8)]
    dpo = DPOTrainer(build_config({"model": {"path": "tiny", "dtype": "float32"}, "logging": {"backends": []},
                                   "trainer": {"kind": "dpo", "device": "cpu", "cpu_matmul": "onednn",
                                               "run_dir": str(tmp_path / "dpo")},
                                   "data": {"train_batch_size": 4}}), train_rows=pairs)
    assert _linear_classes(dpo.model) == _linear_classes(dpo.ref_model) == {OneDNNLinear}


@needs_onednn
def test_a_grpo_step_trains_the_same_on_either_library(tmp_path):
    """Same seed, same samples (the tiny model's decode products are under oneDNN's size), and an update
    whose loss, gradient norm and per-parameter gradients agree to float32 rounding."""
    results = []
    for library in ("aten", "onednn"):
        trainer = RLTrainer(rl_config(tmp_path / library, "trainer.total_steps=1", "actor.micro_batch_size=16",
                                      "rollout.max_new_tokens=24", f"trainer.cpu_matmul={library}"))
        metrics = trainer.step()
        # the gradients the step used (kept on the parameters until the next update)
        results.append((metrics, {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}))
    (m_aten, g_aten), (m_onednn, g_onednn) = results
    assert m_aten["response/length_mean"] == m_onednn["response/length_mean"]
    assert m_aten["reward/mean"] == m_onednn["reward/mean"]
    assert m_onednn["actor/pg_loss"] == pytest.approx(m_aten["actor/pg_loss"], rel=1e-4, abs=1e-7)
    assert m_onednn["actor/grad_norm"] == pytest.approx(m_aten["actor/grad_norm"], rel=1e-4)
    # Gradients, not the weights after the step: Adam divides each gradient by its own size, so float32
    # rounding of a gradient near its eps moves a weight by up to lr, more or less with the CPU (the new weights
    # differed by 8e-6 with AVX-512 kernels, 4e-6 with AVX2 ones). oneDNN runs float32 only: no float64 run.
    assert g_aten.keys() == g_onednn.keys() and all(float(g.abs().max()) > 0 for g in g_aten.values())
    for name, g in g_aten.items():  # ~1e-6 of each tensor's largest entry apart
        torch.testing.assert_close(g_onednn[name], g, rtol=0, atol=1e-5 * float(g.abs().max()), msg=name)
