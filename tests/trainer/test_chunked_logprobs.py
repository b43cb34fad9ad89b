"""`actor.chunked_logprobs`: the policy's log-probs and entropy from its head's input, in token chunks, with no
[B, R, V] logits. In float64 the values and every parameter's gradient (tied embeddings, a biased head, LoRA
adapters, a trained `modules_to_save` head) equal the plain path's within 1e-10, unshared and with shared
prompts, at a temperature and with the entropy term trained. Heads it cannot take are refused by name."""

from __future__ import annotations

import pytest
import torch
from rl_support import LargestVocabTensor, captured_update, random_groups, rl_config

import verl.algorithms.head_logprobs as head_mod
from verl.config.schema import LoraConfig
from verl.errors import ConfigError, ModelError
from verl.models.head import HeadCapture, head_unsupported
from verl.models.lora import AdapterOff, apply_lora
from verl.trainer.forward.logprobs import response_logprobs, shared_prompt_logprobs, use_chunked_logprobs
from verl.utils.positions import position_ids_from_mask

TEMPERATURE = 0.7
TOL = 1e-10


def _tiny(dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=dtype).train()


def _inputs():
    prompt_ids, prompt_mask, response_ids, response_mask, weights = random_groups()
    ids, mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    unshared = (ids, mask, position_ids_from_mask(mask), response_ids.shape[1])
    return (prompt_ids, prompt_mask, response_ids, response_mask), unshared, weights


def _loss_and_grads(model, fn, weights, entropy_coef):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = fn()
    real = weights != 0
    loss = (logprobs * weights).sum() - entropy_coef * (entropy * real).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach()[real], entropy.detach()[real], grads


def _assert_same(model, shared: bool, entropy_coef: float = 0.1):
    shared_args, unshared_args, weights = _inputs()
    weights = weights.to(next(model.parameters()).dtype)

    def run(chunked):
        kwargs = dict(temperature=TEMPERATURE, with_entropy=True, entropy_grad=entropy_coef > 0, chunked=chunked)
        if shared:
            return lambda: shared_prompt_logprobs(model, *shared_args, **kwargs)
        return lambda: response_logprobs(model, *unshared_args, **kwargs)

    want = _loss_and_grads(model, run(False), weights, entropy_coef)
    got = _loss_and_grads(model, run(True), weights, entropy_coef)
    assert torch.allclose(got[0], want[0], rtol=0, atol=TOL) and torch.allclose(got[1], want[1], rtol=0, atol=TOL)
    assert set(got[2]) == set(want[2]) and want[2]
    for name, g in want[2].items():
        assert torch.allclose(got[2][name], g, rtol=0, atol=TOL), (name, float((got[2][name] - g).abs().max()))
    return want[2]


@pytest.fixture(scope="module")
def tied():
    model = _tiny()
    assert model.lm_head.weight is model.get_input_embeddings().weight  # the tiny model ties like Qwen2.5-0.5B
    return model


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_tied_embeddings_equal_the_plain_path_in_float64(tied, shared, entropy_coef):
    grads = _assert_same(tied, shared, entropy_coef)
    assert float(grads["model.embed_tokens.weight"].abs().max()) > 0


def test_a_head_with_a_bias_and_several_chunks(monkeypatch):
    model = _tiny()
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        head.bias[:5] = -torch.inf  # banned ids
    model.lm_head = head
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", model.config.vocab_size * 5)  # 5 tokens per chunk
    grads = _assert_same(model, shared=False)
    assert float(grads["lm_head.bias"].abs().max()) > 0 and torch.equal(grads["lm_head.bias"][:5], torch.zeros(5,
                                                                                        dtype=torch.float64))


@pytest.fixture(scope="module")
def lora_policy():
    model = apply_lora(_tiny(), LoraConfig(rank=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.train()


@pytest.mark.parametrize("shared", [False, True])
def test_lora_adapters_get_the_plain_gradients(lora_policy, shared):
    grads = _assert_same(lora_policy, shared)
    assert all("lora_" in n for n in grads)  # the frozen head and embeddings get none (and cost none)


def test_the_lora_reference_with_adapters_off(lora_policy):
    ref = AdapterOff(lora_policy)
    shared_args, unshared_args, weights = _inputs()
    real = weights != 0
    with torch.no_grad():
        want, _ = response_logprobs(ref, *unshared_args, temperature=TEMPERATURE)
        got, _ = response_logprobs(ref, *unshared_args, temperature=TEMPERATURE, chunked=True)
        got_shared, _ = shared_prompt_logprobs(ref, *shared_args, temperature=TEMPERATURE, chunked=True)
        adapters_on, _ = response_logprobs(lora_policy, *unshared_args, temperature=TEMPERATURE, chunked=True)
    assert torch.allclose(got[real], want[real], rtol=0, atol=TOL)
    assert torch.allclose(got_shared[real], want[real], rtol=0, atol=1e-9)
    assert float((adapters_on - got)[real].abs().max()) > 1e-3


def test_a_trained_modules_to_save_head_and_its_original_under_adapters_off():
    untied = _tiny()
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    untied.config.tie_word_embeddings = False  # (a tied head's peft copy keeps the embedding's weight)
    model = apply_lora(untied, LoraConfig(rank=4, modules_to_save=["lm_head"]))
    assert type(model.get_base_model().lm_head).__name__ == "ModulesToSaveWrapper"
    assert head_unsupported(model) is None
    with torch.no_grad():  # make the trained copy differ from the original
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.05 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(1)))
    grads = _assert_same(model, shared=False)
    assert any("modules_to_save" in n for n in grads)
    _, unshared_args, weights = _inputs()
    with torch.no_grad():
        want, _ = response_logprobs(AdapterOff(model), *unshared_args)
        got, _ = response_logprobs(AdapterOff(model), *unshared_args, chunked=True)
        on, _ = response_logprobs(model, *unshared_args, chunked=True)
    real = weights != 0
    assert torch.allclose(got[real], want[real], rtol=0, atol=TOL) and float((on - got)[real].abs().max()) > 1e-3



@pytest.mark.parametrize("shared", [False, True])
def test_no_logits_beyond_one_chunk_forward_or_backward(monkeypatch, shared):
    model = _tiny(torch.float32)
    vocab = model.config.vocab_size
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", vocab * 4)
    shared_args, unshared_args, weights = _inputs()
    with LargestVocabTensor(vocab) as probe:
        if shared:
            lp, ent = shared_prompt_logprobs(model, *shared_args, with_entropy=True, chunked=True)
        else:
            lp, ent = response_logprobs(model, *unshared_args, with_entropy=True, chunked=True)
        ((lp * weights.float()).sum() + 0.1 * ent.sum()).backward()
    rows = weights.shape[0]  # the model's own logits: one position per sequence (the head's check)
    assert probe.rows <= max(4, rows) < weights.numel()


def test_a_head_on_onednn_is_one_linear_projection():
    """`trainer.cpu_matmul=onednn` swaps the head's class to OneDNNLinear: still one projection, same gradients."""
    from verl.utils.cpu_matmul import OneDNNLinear, use_cpu_matmul

    model = use_cpu_matmul(_tiny(), "onednn")
    assert type(model.lm_head) is OneDNNLinear and head_unsupported(model) is None
    _assert_same(model, shared=True)


def test_heads_it_cannot_take_are_named():
    lora_head = apply_lora(_tiny(torch.float32), LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]))
    assert "not one linear projection" in head_unsupported(lora_head)
    softcapped = _tiny(torch.float32)
    softcapped.config.final_logit_softcapping = 30.0
    assert "transforms the head's logits (final_logit_softcapping=30.0)" in head_unsupported(softcapped)
    with pytest.raises(ModelError, match="chunked log-probs need a plain linear output head"):
        HeadCapture(softcapped)


def test_a_model_that_changes_the_logits_after_the_head_is_caught_at_the_first_forward():
    model = _tiny(torch.float32)
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5  # a logit scale the config does not announce
        return out

    model.forward = scaled
    _, unshared_args, _ = _inputs()
    with pytest.raises(ModelError, match="logits are not its linear projection.*actor.chunked_logprobs=false"):
        response_logprobs(model, *unshared_args, chunked=True)


def test_the_run_level_decision(tmp_path):
    model = _tiny(torch.float32)
    auto = rl_config(tmp_path)
    assert not use_chunked_logprobs(auto, model)  # 8 x 4 response tokens x 768 ids: far below 2^28 logits
    assert use_chunked_logprobs(rl_config(tmp_path, "actor.chunked_logprobs=true"), model)
    big = rl_config(tmp_path, "rollout.max_new_tokens=4096", "actor.micro_batch_size=128")
    assert use_chunked_logprobs(big, model)  # 524k response tokens x 768 >= 2^28
    lora_head = apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]))
    assert not use_chunked_logprobs(big, lora_head)  # auto falls back to the logits
    with pytest.raises(ConfigError, match=r"actor.chunked_logprobs=true, but .* Fix: set actor.chunked_logprobs=auto"):
        use_chunked_logprobs(rl_config(tmp_path, "actor.chunked_logprobs=true"), lora_head)
    assert not use_chunked_logprobs(rl_config(tmp_path, "actor.chunked_logprobs=false"), model)


def test_the_rl_update_is_the_same_with_and_without(tmp_path, monkeypatch):
    """One GRPO update (entropy bonus and KL loss on, shared prompts) through RLTrainer: the same losses and
    gradients in float32, and the reference's log-probs too."""
    from verl.trainer import rl_trainer
    from verl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer(rl_config(tmp_path, "actor.kl_loss_coef=0.1", "actor.entropy_coef=0.01",
                                  "trainer.total_steps=1", "rollout.max_new_tokens=6", "actor.micro_batch_size=8",
                                  "actor.shuffle=false", "rollout.temperature=0.8", "actor.chunked_logprobs=true"))
    assert (use_chunked_logprobs(trainer.config, trainer.model)
            and use_chunked_logprobs(trainer.config, trainer.ref_model))
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    batch = trainer.compute_advantages(trainer.compute_ref_log_probs(trainer.compute_log_probs(batch)))
    chunked_ref = batch.ref_logprobs.clone()
    got, got_metrics, _ = captured_update(trainer, trainer.model, trainer.update_policy, batch)
    monkeypatch.setattr(rl_trainer, "use_chunked_logprobs", lambda config, model: False)  # the plain logits
    plain_ref = trainer.compute_ref_log_probs(batch).ref_logprobs
    want, want_metrics, _ = captured_update(trainer, trainer.model, trainer.update_policy, batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(chunked_ref[mask], plain_ref[mask], atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key
    assert set(got) == set(want)
    for name, g in want.items():
        assert float((got[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-30), name
