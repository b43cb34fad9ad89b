"""The shared-prompt forward on LoRA policies (peft wrappers) and on their reference, the policy with its
adapters off (`AdapterOff`): the peft forward hands the cache arguments to the Hugging Face model under it,
so each group's prompt runs once there too. Log-probs, loss and every LoRA parameter's gradient equal the
unshared forward (float32, 1e-5 of the tensor's scale), and so do the reference's log-probs."""

from __future__ import annotations

import pytest
import torch
from rl_support import captured_update, random_groups, rl_config

from verl.config.schema import LoraConfig
from verl.models.lora import AdapterOff, apply_lora, base_of, is_peft_model
from verl.trainer.forward.logprobs import can_share_prompt, response_logprobs, shared_prompt_logprobs
from verl.utils.positions import position_ids_from_mask

TOL = 1e-5


def _random_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """lora_B starts at zero (adapters off in effect, lora_A without gradient): make every adapter random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _close(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    assert float((got - want).abs().max()) <= TOL * max(float(want.abs().max()), 1e-30), name


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=torch.float32)
    model = apply_lora(model, LoraConfig(rank=4))
    _random_adapters(model)
    return model.train()


def _inputs():
    prompt_ids, prompt_mask, response_ids, response_mask, weights = random_groups()
    ids, mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    unshared = (ids, mask, position_ids_from_mask(mask), response_ids.shape[1])
    return (prompt_ids, prompt_mask, response_ids, response_mask), unshared, weights.float()


def test_lora_policy_shares_prompts_with_the_unshared_loss_and_adapter_gradients(policy):
    assert is_peft_model(policy) and can_share_prompt(policy)
    shared_args, unshared_args, weights = _inputs()
    forwards = []
    hook = base_of(policy).register_forward_hook(
        lambda m, args, kwargs, out: forwards.append(kwargs["input_ids"].shape), with_kwargs=True)

    def run(fn):
        policy.zero_grad(set_to_none=True)
        logprobs, entropy = fn()
        loss = (logprobs * weights).sum() + (entropy * (weights != 0)).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        return float(loss.detach()), logprobs.detach(), grads

    want_loss, want_lp, want = run(lambda: response_logprobs(policy, *unshared_args, with_entropy=True))
    forwards.clear()
    got_loss, got_lp, got = run(lambda: shared_prompt_logprobs(policy, *shared_args, with_entropy=True))
    hook.remove()
    assert forwards == [(3, 6), (12, 6)]  # the LoRA model ran the 3 prompts once, then the 12 responses
    assert got_loss == pytest.approx(want_loss, rel=TOL)
    real = shared_args[3].bool()
    _close(got_lp[real], want_lp[real])
    assert want and all("lora_" in n for n in want) and set(got) == set(want)
    assert all(float(g.abs().max()) > 0 for g in want.values())  # every adapter matrix gets a gradient
    for name, g in want.items():
        _close(got[name], g, name)


def test_adapter_off_reference_shares_prompts_with_the_unshared_logprobs(policy):
    ref = AdapterOff(policy)
    assert can_share_prompt(ref)
    shared_args, unshared_args, _ = _inputs()
    with torch.no_grad():
        want, _ = response_logprobs(ref, *unshared_args)
        got, _ = shared_prompt_logprobs(ref, *shared_args)
        with_adapters, _ = shared_prompt_logprobs(policy, *shared_args)
    real = shared_args[3].bool()
    _close(got[real], want[real])
    assert float((with_adapters - got)[real].abs().max()) > 1e-3  # the adapters were off for the reference
    assert policy.training  # AdapterOff hands the policy back in the mode it found it


def test_prompt_learning_wrappers_keep_the_plain_forward():
    import peft
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=torch.float32)
    prefix = peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert not can_share_prompt(prefix)  # it puts its own virtual tokens into the cache


def test_rl_trainer_with_lora_shares_prompts_for_the_update_and_the_reference(tmp_path):
    from verl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer(rl_config(tmp_path, "model.lora.rank=4", "actor.kl_loss_coef=0.1", "trainer.total_steps=1",
                                  "rollout.max_new_tokens=8", "actor.micro_batch_size=8", "actor.shuffle=false"))
    _random_adapters(trainer.model)
    assert isinstance(trainer.ref_model, AdapterOff)
    assert trainer.shares_prompt(trainer.model) and trainer.shares_prompt(trainer.ref_model)
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    batch = trainer.compute_advantages(trainer.compute_ref_log_probs(trainer.compute_log_probs(batch)))
    shared_ref = batch.ref_logprobs.clone()

    got, got_metrics, _ = captured_update(trainer, trainer.model, trainer.update_policy, batch)
    trainer.config.actor.share_prompt_forward = False
    plain_ref = trainer.compute_ref_log_probs(batch).ref_logprobs
    want, want_metrics, _ = captured_update(trainer, trainer.model, trainer.update_policy, batch)
    mask = batch.response_mask.bool()
    _close(shared_ref[mask], plain_ref[mask])
    assert got_metrics["actor/kl_loss"] == pytest.approx(want_metrics["actor/kl_loss"], rel=TOL, abs=1e-9)
    assert got_metrics["actor/pg_loss"] == pytest.approx(want_metrics["actor/pg_loss"], rel=TOL, abs=1e-9)
    assert want and all("lora_" in n for n in want) and set(got) == set(want)
    for name, g in want.items():
        _close(got[name], g, name)
