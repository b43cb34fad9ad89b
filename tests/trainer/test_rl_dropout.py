"""Dropout and PPO: the no-grad passes (old/ref log-probs, values) run in eval mode, and
`actor.disable_dropout` (default) removes dropout from the policy, so the first ratio is exactly 1."""

from __future__ import annotations

import torch
from rl_support import read_metrics, rl_config

from verl.models.dropout import disable_dropout
from verl.trainer.build.models import resolve_model_path
from verl.trainer.rl_trainer import RLTrainer
from verl.utils.hf_loader import load_hf_model


def dropout_rates(model: torch.nn.Module) -> list[float]:
    return [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")]


def model_with_dropout(p: float = 0.1):
    model, tokenizer = load_hf_model(resolve_model_path("tiny"), for_training=True)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = p
    model.config.attention_dropout = p
    assert dropout_rates(model) and set(dropout_rates(model)) == {p}
    return model, tokenizer


def test_policy_dropout_is_disabled_by_default_and_the_first_ratio_is_exactly_one(tmp_path):
    model, tokenizer = model_with_dropout()
    config = rl_config(tmp_path, "trainer.total_steps=1", "actor.kl_loss_coef=0.01",
                       "actor.old_logprobs=recompute")  # old log-probs computed by the trainer's no-grad pass
    trainer = RLTrainer(config, model=model, tokenizer=tokenizer)
    assert set(dropout_rates(trainer.model)) == {0.0} and trainer.model.config.attention_dropout == 0.0
    assert set(dropout_rates(trainer.ref_model)) == {0.0}
    trainer.fit()
    first = read_metrics(tmp_path)[0]
    assert first["actor/approx_kl"] == 0.0 and first["actor/clipfrac"] == 0.0


def test_no_grad_passes_run_without_dropout_and_restore_train_mode(tmp_path):
    model, tokenizer = model_with_dropout()
    config = rl_config(tmp_path, "trainer.total_steps=1", "actor.disable_dropout=false", "actor.kl_loss_coef=0.01")
    trainer = RLTrainer(config, model=model, tokenizer=tokenizer)
    assert set(dropout_rates(trainer.model)) == {0.1}  # the user asked to keep it
    batch = trainer.generate(trainer.get_batch())
    trainer.model.train()
    first = trainer.sequence_logprobs(trainer.model, batch)
    second = trainer.sequence_logprobs(trainer.model, batch)
    assert trainer.model.training  # the mode is restored
    assert torch.equal(first, second)  # dropout would make two passes differ
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.sequence_logprobs(trainer.model, batch)
    assert torch.equal(first, want)


def test_disable_dropout_zeroes_modules_attributes_and_config():
    model, _ = model_with_dropout(0.2)
    extra = torch.nn.Dropout(0.3)
    model.add_module("extra_dropout", extra)
    assert disable_dropout(model) >= 3
    assert set(dropout_rates(model)) == {0.0} and extra.p == 0.0 and model.config.attention_dropout == 0.0
    assert disable_dropout(model) == 0
