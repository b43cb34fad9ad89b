"""The critic's shared-prompt forward (`critic.share_prompt_forward`): each group's prompt runs once and its
responses on the cached keys/values, in the no-grad value pass and in the critic update. Values, value loss
and every critic parameter's gradient equal the unshared forward (float32, 1e-5 of the tensor's scale), with
fixed and token-budget micro-batches; the update's gradient also equals one big-batch computation."""

from __future__ import annotations

import pytest
import torch
from rl_support import captured_update, random_groups, rl_config

from verl.algorithms import value_loss
from verl.trainer.forward.logprobs import can_share_prompt, response_values, shared_prompt_values
from verl.trainer.rl_trainer import RLTrainer
from verl.utils.positions import position_ids_from_mask

TOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    scale = max(float(want.abs().max()), 1e-30)
    assert float((got - want).abs().max()) <= TOL * scale, name


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want) and want
    for name, g in want.items():
        _close(got[name], g, name)
    backbone = [g for n, g in want.items() if not n.startswith("value_head.")]
    assert backbone and any(float(g.abs().max()) > 0 for g in backbone)  # the comparison is not vacuous


def _random_head(critic: torch.nn.Module, seed: int = 0) -> None:
    """The head starts at zero, which would give the backbone a zero gradient: make it random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=g))


@pytest.mark.parametrize("prompt, lora", [(7, False), (1, False), (7, True)])
def test_shared_prompt_values_and_gradients_equal_the_unshared_forward(prompt, lora):
    from verl.config.schema import LoraConfig
    from verl.models.critic import ValueModel
    from verl.models.lora import base_of
    from verl.models.tiny import build_tiny_model

    critic = ValueModel.from_pretrained(build_tiny_model(seed=0), dtype=torch.float32)
    if lora:  # critic.lora: a peft wrapper around the backbone, with random adapters
        critic.add_lora(LoraConfig(rank=4))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in critic.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    _random_head(critic)
    assert can_share_prompt(critic)
    prompt_ids, prompt_mask, response_ids, response_mask, weights = random_groups(prompt=prompt)
    forwards = []
    base_of(critic.backbone).register_forward_hook(
        lambda m, args, kwargs, out: forwards.append(kwargs["input_ids"].shape), with_kwargs=True)

    def run(fn):
        critic.zero_grad(set_to_none=True)
        values = fn()
        (values * weights.float()).sum().backward()
        return values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters() if p.requires_grad}

    ids, mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    want_v, want = run(lambda: response_values(critic, ids, mask, position_ids_from_mask(mask), 6))
    forwards.clear()
    got_v, got = run(lambda: shared_prompt_values(critic, prompt_ids, prompt_mask, response_ids, response_mask))
    groups = len(torch.unique(prompt_ids, dim=0))
    assert forwards == [(groups, max(prompt - 1, 1)), (12, 5 + (prompt > 1))]  # prompts once, then responses
    assert got_v.shape == want_v.shape == (12, 6) and got_v.dtype == torch.float32
    real = response_mask.bool()
    _close(got_v[real], want_v[real])
    _assert_same(got, want)
    assert not lora or all("lora_" in n or n.startswith("value_head.") for n in want)


def _trainer(tmp_path, *overrides) -> RLTrainer:
    trainer = RLTrainer(rl_config(tmp_path, "algorithm.adv_estimator=gae", "trainer.total_steps=1",
                                  "rollout.max_new_tokens=10", "critic.shuffle=false", *overrides))
    _random_head(trainer.critic)
    return trainer


def _batch(trainer: RLTrainer):
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    return trainer.compute_advantages(trainer.compute_values(trainer.compute_log_probs(batch)))


def _critic_update(trainer: RLTrainer, batch, share: bool, monkeypatch):
    """update_critic's accumulated gradient (captured instead of stepped), its forwards, and its value loss
    put together from the micro-batches' losses (each weighted by its share of tokens or sequences)."""
    import verl.trainer.rl.update as rl

    trainer.config.critic.share_prompt_forward = share
    losses = []

    def recording(values, old, returns, mask, **kwargs):
        loss, stats = value_loss(values, old, returns, mask, **kwargs)
        units = mask.sum() if kwargs["agg"] == "token-mean" else (mask.sum(-1) > 0).sum()
        losses.append((float(loss.detach()), float(units)))
        return loss, stats

    monkeypatch.setattr(rl, "value_loss", recording)

    captured, _, forwards = captured_update(trainer, trainer.critic, trainer.update_critic, batch)
    total = sum(u for _, u in losses)
    return captured, forwards, sum(loss * u for loss, u in losses) / total


def _big_batch(trainer: RLTrainer, batch) -> tuple[dict[str, torch.Tensor], float]:
    """One unshared forward of the whole batch, one value loss, one backward: the gradients and the loss."""
    cfg, critic = trainer.config.critic, trainer.critic
    critic.zero_grad(set_to_none=True)
    values = response_values(critic, batch.input_ids, batch.attention_mask, batch.position_ids,
                             batch.response_ids.shape[1])
    loss, _ = value_loss(values, batch.values, batch.returns, batch.response_mask.float(), clip_range=cfg.value_clip,
                         agg=cfg.loss_agg)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)
    return grads, float(loss.detach())


@pytest.mark.parametrize("extra", [("critic.micro_batch_size=3",), ("critic.micro_batch_size=8",),
                                   ("critic.max_tokens_per_micro_batch=60",),
                                   ("critic.max_tokens_per_micro_batch=60", "critic.loss_agg=seq-mean-token-sum")])
def test_the_critic_update_with_shared_prompts_keeps_the_loss_and_gradient(tmp_path, extra, monkeypatch):
    trainer = _trainer(tmp_path, *extra)
    assert trainer.shares_prompt(trainer.critic)
    batch = _batch(trainer)
    want, want_loss = _big_batch(trainer, batch)
    got, forwards, loss = _critic_update(trainer, batch, True, monkeypatch)
    plain_grads, plain_forwards, plain_loss = _critic_update(trainer, batch, False, monkeypatch)
    _assert_same(got, want)
    _assert_same(plain_grads, want)
    # each micro-batch: one prompt forward, one response forward (a budget packs the two ways differently)
    assert forwards % 2 == 0 and (forwards == 2 * plain_forwards or "max_tokens" in extra[0])
    assert want_loss > 0
    assert loss == pytest.approx(want_loss, rel=TOL) and plain_loss == pytest.approx(want_loss, rel=TOL)


@pytest.mark.parametrize("budget", [None, 40])
def test_shared_value_pass_equals_the_unshared_pass(tmp_path, budget):
    trainer = _trainer(tmp_path, "critic.micro_batch_size=3", f"critic.max_tokens_per_micro_batch={budget or 'null'}")
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    forwards = []
    hook = trainer.critic.register_forward_hook(lambda *a: forwards.append(1))
    shared = trainer.compute_values(batch).values.clone()
    shared_forwards = len(forwards)
    trainer.config.critic.share_prompt_forward = False
    plain = trainer.compute_values(batch).values
    hook.remove()
    assert shared_forwards == 2 * (len(forwards) - shared_forwards)
    mask = batch.response_mask.bool()
    assert float(plain[mask].abs().max()) > 0
    _close(shared[mask], plain[mask])


def test_the_critic_option_is_its_own(tmp_path):
    trainer = _trainer(tmp_path, "critic.share_prompt_forward=false")
    assert not trainer.shares_prompt(trainer.critic) and trainer.shares_prompt(trainer.model)
    trainer.config.critic.share_prompt_forward, trainer.config.actor.share_prompt_forward = True, False
    assert trainer.shares_prompt(trainer.critic) and not trainer.shares_prompt(trainer.model)
