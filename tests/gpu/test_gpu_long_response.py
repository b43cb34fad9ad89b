"""Long responses on CUDA: chunked log-probs (`actor.chunked_logprobs`) and activation offload
(`actor.activation_offload`) lower the peak of a GRPO micro-batch on an 8k-token response at the Qwen2.5-0.5B
width and vocabulary (4 layers, bf16, checkpointed) with the same gradients, and the memory plan's estimate of
that peak is within 25% of `torch.cuda.max_memory_allocated`. The CPU counterparts:
tests/distributed/test_memory_plan_measured.py, tests/trainer/test_chunked_logprobs.py,
tests/trainer/test_offload.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT, RESPONSE, LAYERS = 64, 8192, 4


def _model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from verl.distributed.fsdp import checkpoint_decoder_layers

    config = Qwen2Config(hidden_size=896, num_hidden_layers=LAYERS, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151_936, tie_word_embeddings=True,
                         max_position_embeddings=PROMPT + RESPONSE + 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().train()
    checkpoint_decoder_layers(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def _micro_batch(model, ids, *, chunked: bool, offload: bool) -> tuple[int, dict[str, torch.Tensor]]:
    """Peak bytes beyond weights + gradients of one micro-batch, and the gradients it adds."""
    from verl.algorithms import ppo_policy_loss
    from verl.distributed.offload import activations_offloaded
    from verl.trainer.forward.logprobs import response_logprobs

    for p in model.parameters():
        p.grad.zero_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    state = torch.cuda.memory_allocated()
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1], device="cuda")[None]
    with activations_offloaded(offload, ids.device):
        logprobs, _ = response_logprobs(model, ids, mask, positions, RESPONSE, with_entropy=True, entropy_grad=False,
                                        chunked=chunked)
    advantages = torch.randn(1, RESPONSE, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss, _ = ppo_policy_loss(logprobs, logprobs.detach(), advantages, torch.ones(1, RESPONSE, device="cuda"))
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - state, {n: p.grad.float().clone() for n, p in model.named_parameters()}


def test_chunked_logprobs_and_activation_offload_on_an_8k_response():
    from verl.distributed.fsdp import find_decoder_layers
    from verl.distributed.memory_plan import CUDA_RUNTIME_BYTES, ModelShape, PlanInputs, plan_memory

    model = _model()
    ids = torch.randint(0, 151_936, (1, PROMPT + RESPONSE), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    plain, want = _micro_batch(model, ids, chunked=False, offload=False)
    chunked, got = _micro_batch(model, ids, chunked=True, offload=False)
    offloaded, got_offloaded = _micro_batch(model, ids, chunked=True, offload=True)
    assert chunked <= 0.35 * plain, (chunked, plain)
    assert offloaded <= 1.05 * chunked, (offloaded, chunked)  # (4 layers: little to offload; no worse)
    for name, g in want.items():  # bf16 logits either way: equal up to bf16 rounding of the head's gradient
        scale = float(g.abs().max())
        torch.testing.assert_close(got[name], g, rtol=2e-2, atol=2e-2 * scale, msg=name)
        assert torch.equal(got_offloaded[name], got[name]), name  # offload copies, it does not compute

    shape = ModelShape.from_model(model, find_decoder_layers(model)[0])
    for measured, kwargs in ((plain, {}), (chunked, {"chunked_logprobs": True})):
        x = PlanInputs(shape=shape, resident={}, compute_bytes=2, master_bytes=2, micro_batch=1, prompt_len=PROMPT,
                       response_len=RESPONSE, activation_checkpointing=True, sharded=False, padded_mask=False,
                       **kwargs)
        estimate = plan_memory(x, None).update_peak - CUDA_RUNTIME_BYTES
        assert estimate == pytest.approx(measured, rel=0.25), (kwargs, estimate, measured)
