"""`actor.remove_padding` / `critic.remove_padding`: a micro-batch's sequences packed into one row without their
padding, each attending only to itself (verl's per-sequence attention, or transformers' packed mask where that
does not apply). In float64 the log-probs, entropy and every gradient equal the padded forward's within 1e-10
(temperature, entropy trained, chunked head, multi-turn observations inside the response), the values in float32;
an RL run trains the same weights either way (token budget, LoRA, a critic); a model whose attention ignores
packed position ids is refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rl_support import batch_of_lengths, random_groups, rl_config

from verl.errors import ConfigError
from verl.models.critic import ValueModel
from verl.trainer.forward import packing
from verl.trainer.forward.logprobs import packed_logprobs, packed_values, response_logprobs, response_values
from verl.trainer.rl_trainer import RLTrainer
from verl.utils.positions import position_ids_from_mask

TOL = 1e-10


def _tiny(dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=dtype).train()


def _batch(observation_gap: bool = False):
    prompt_ids, prompt_mask, response_ids, response_mask, weights = random_groups(groups=3, n=3, prompt=7,
                                                                                  response=9)
    attention = response_mask.clone()
    if observation_gap:  # a multi-turn episode: tokens 2-3 are an observation, attended but not in the loss
        response_mask[:, 2:4] = 0
        weights = weights * response_mask
    mask = torch.cat([prompt_mask, attention], 1)
    return SimpleNamespace(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                           response_attention=attention, input_ids=torch.cat([prompt_ids, response_ids], 1),
                           attention_mask=mask, position_ids=position_ids_from_mask(mask)), weights


def _loss_and_grads(model, fn, weights, mask):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = fn()
    loss = (logprobs * weights).sum() - 0.1 * (entropy * mask).sum()
    loss.backward()
    return logprobs.detach()[mask], entropy.detach()[mask], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("observation_gap", [False, True])
@pytest.mark.parametrize("attention", ["per sequence", "packed mask"])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_forward_in_float64(chunked, observation_gap,
                                                                                    attention, monkeypatch):
    if attention == "packed mask":  # transformers' block-diagonal mask instead of verl's per-sequence attention
        monkeypatch.setattr(packing, "varlen_ready", lambda model: False)
    model = _tiny()
    mb, weights = _batch(observation_gap)
    kwargs = dict(temperature=0.7, with_entropy=True, chunked=chunked)
    mask = mb.response_attention.bool()
    padded = _loss_and_grads(model, lambda: response_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                                              mb.response_ids.shape[1], **kwargs), weights, mask)
    packed = _loss_and_grads(model, lambda: packed_logprobs(model, mb, **kwargs), weights, mask)
    assert torch.allclose(packed[0], padded[0], rtol=0, atol=TOL)
    assert torch.allclose(packed[1], padded[1], rtol=0, atol=TOL)
    for name, g in padded[2].items():
        assert float(g.abs().max()) > 0 and torch.allclose(packed[2][name], g, rtol=0, atol=TOL), name
    logprobs, _ = packed_logprobs(model, mb)
    assert bool((logprobs[~mask] == 0).all())  # padding positions hold 0


def test_packed_values_and_their_gradients_equal_the_padded_forward():
    from verl.models.tiny import build_tiny_model

    critic = ValueModel.from_pretrained(build_tiny_model(seed=0), dtype=torch.float32)  # its head computes in float32
    with torch.no_grad():  # a random head (it starts at 0, which would leave the backbone without a gradient)
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape,
                                                   generator=torch.Generator().manual_seed(0)))
    mb, weights = _batch()
    mask = mb.response_attention.bool()

    def run(fn):
        critic.zero_grad(set_to_none=True)
        values = fn()
        (values * weights.float()).sum().backward()
        return values.detach()[mask], {n: p.grad.clone() for n, p in critic.named_parameters()}

    def close(got, want):
        return float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())

    padded = run(lambda: response_values(critic, mb.input_ids, mb.attention_mask, mb.position_ids,
                                         mb.response_ids.shape[1]))
    packed = run(lambda: packed_values(critic, mb))
    assert close(packed[0], padded[0])
    for name, g in padded[1].items():
        assert float(g.abs().max()) > 0 and close(packed[1][name], g), name


class _IgnoresPackedPositions(torch.nn.Module):
    """A model whose attention is causal over the whole row whatever the position ids say."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids,
                          **kwargs)


def test_the_packed_attention_runs_each_sequence_alone():
    model = _tiny()
    mb, _ = _batch()
    packed_logprobs(model, mb)  # the first packed forward probes the model (two short sequences)
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[2], kwargs.get("is_causal"), kwargs.get("attn_mask")))
        return original(q, k, v, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        packed_logprobs(model, mb)
    lengths = mb.attention_mask.sum(-1).tolist()
    assert [c[0] for c in calls] == lengths * model.config.num_hidden_layers  # one call per sequence and layer
    assert all(causal and mask is None for _, causal, mask in calls)
    padded, _ = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_ids.shape[1])
    packed, _ = packed_logprobs(model, mb)  # generation and padded forwards keep the original attention
    assert torch.allclose(packed[mb.response_attention.bool()], padded[mb.response_attention.bool()], atol=TOL)


class _DropsKeywords(torch.nn.Module):
    """A wrapper that takes any keyword and hands only its named arguments down (the sequence lengths are lost)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_a_wrapper_that_drops_the_sequence_lengths_is_refused():
    mb, _ = _batch()
    with pytest.raises(ConfigError, match=r"_DropsKeywords attends across packed sequences"):
        packed_logprobs(_DropsKeywords(_tiny(torch.float32)), mb)


def test_a_model_that_attends_across_packed_sequences_is_refused(monkeypatch):
    monkeypatch.setattr(packing, "varlen_ready", lambda model: False)  # a model verl's attention does not cover
    mb, _ = _batch()
    with pytest.raises(ConfigError, match=r"actor.remove_padding=true, but _IgnoresPackedPositions attends across "
                                          r"packed sequences.*Fix: set actor.remove_padding=false"):
        packed_logprobs(_IgnoresPackedPositions(_tiny(torch.float32)), mb)


@pytest.mark.parametrize("case", ["grpo", "token budget", "lora", "gae", "checkpointing"])
def test_an_rl_run_trains_the_same_weights_packed_or_padded(tmp_path, case):
    extra = {"token budget": ["actor.max_tokens_per_micro_batch=40"], "lora": ["model.lora.rank=4", "actor.lr=1e-2"],
             "gae": ["algorithm.adv_estimator=gae"],
             "checkpointing": ["fsdp.activation_checkpointing=true"]}.get(case, [])  # lengths reach the recompute

    # float64: packed and padded forwards sum in different orders, and Adam divides each gradient by its own
    # running size, so a float32 rounding difference in a near-zero gradient becomes an lr-sized weight change
    # after the step, larger or smaller with the CPU's kernel (1e-5 was met on one machine only); in float64 the
    # runs agree to ~1e-6 after two steps, under either kernel.
    def run(packed: bool):
        torch.manual_seed(0)
        trainer = RLTrainer(rl_config(tmp_path / f"{case}-{packed}", "model.dtype=float64",
                                      f"actor.remove_padding={packed}", f"critic.remove_padding={packed}",
                                      "actor.kl_loss_coef=0.1", "actor.ppo_epochs=2", "rollout.max_new_tokens=8",
                                      *extra))
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        metrics = [trainer.step() for _ in range(2)]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert max(float((w - start[n]).abs().max()) for n, w in weights.items()) > 1e-3  # the update moved them
        return metrics, weights

    (m_pad, w_pad), (m_packed, w_packed) = run(False), run(True)
    assert m_pad[-1]["response/length_mean"] == m_packed[-1]["response/length_mean"]  # the same samples
    assert m_packed[-1]["actor/pg_loss"] == pytest.approx(m_pad[-1]["actor/pg_loss"], abs=1e-8)
    for name, w in w_pad.items():
        assert torch.allclose(w_packed[name], w, atol=1e-5), name


def test_a_token_budget_counts_the_real_tokens_when_packed():
    from verl.trainer.rl import update

    batch = batch_of_lengths([2, 9, 3, 8, 1, 7])
    groups = update.micro_batch_groups(batch, 8, 24, packed=True)
    assert [g.tolist() for g in groups] == [[1, 3], [5, 2, 0, 4]]  # 11+10=21 (+9 > 24); 9+5+4+3=21
    padded = update.micro_batch_groups(batch, 8, 24)
    assert len(padded) == 3  # rows x longest: (2+9)*2, (2+7)*2, (2+2)*2


def test_verl_check_says_how_sequences_are_packed(tmp_path):
    from verl.config import load_config
    from verl.trainer.forward.packing import describe_remove_padding

    def says(*overrides, facts=None):
        config = load_config(overrides=["env.name=arithmetic", "rollout.n=4", *overrides])
        return describe_remove_padding(config, {"model_type": "qwen2"} if facts is None else facts)

    assert says() is None
    assert says("actor.remove_padding=true") == (
        "actor.remove_padding: micro-batches packed into one row without padding; each packed sequence attends "
        "alone (verl's per-sequence attention); it replaces the actor's shared-prompt forward")
    assert "transformers' packed-sequence mask, probed" in says("actor.remove_padding=true",
                                                                facts={"model_type": "gemma2"})
    assert "flash_attention_2 attends within each packed sequence itself" in says(
        "actor.remove_padding=true", "model.attn_implementation=flash_attention_2")
    assert says("critic.remove_padding=true") is None  # GRPO has no critic
    assert says("critic.remove_padding=true", "algorithm.adv_estimator=gae").startswith("critic.remove_padding: ")
