"""The memory plan's forward/backward terms against a measurement: the bytes of every tensor a GRPO micro-batch
makes, alive at once at its peak (a TorchDispatchMode adds each storage when an operator returns it and
subtracts it when Python frees it), beyond weights and gradients. A small Qwen2 with tied embeddings, float32,
one response (unpadded, and left-padded: sdpa's 4-D mask), plain and chunked log-probs, with and without
checkpointing, and an SFT micro-batch: within 20%.
benchmarks/long_response_memory.py measures the same at the Qwen2.5-0.5B shape for 2k-16k tokens."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from verl.algorithms import ppo_policy_loss
from verl.distributed.fsdp import checkpoint_decoder_layers, find_decoder_layers
from verl.distributed.memory_plan import CUDA_RUNTIME_BYTES, ModelShape, PlanInputs, plan_memory
from verl.trainer.forward.logprobs import response_logprobs

PROMPT, RESPONSE = 16, 1024


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that operators return, from then until Python frees them."""

    def __init__(self, existing: set[int]) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.existing, self.now, self.peak = existing, 0, 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.live and id(storage) not in self.existing:
                    self.live[id(storage)] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, id(storage))
        return out


def _model(checkpointing: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=8192, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float().train()
    if checkpointing:
        checkpoint_decoder_layers(model)
    for p in model.parameters():  # the gradients of an earlier micro-batch of the update
        p.grad = torch.zeros_like(p)
    return model


@pytest.mark.parametrize("chunked, checkpointing, padded", [(False, True, False), (True, True, False),
                                                             (False, False, False), (True, False, False),
                                                             (True, True, True)])
def test_the_plan_is_within_20_percent_of_the_measured_peak(monkeypatch, chunked, checkpointing, padded):
    import verl.algorithms.head_logprobs as head_mod

    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", 8192 * 64)  # 64 tokens per chunk: 16 chunks
    model = _model(checkpointing)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (1, PROMPT + RESPONSE), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0 if padded else 1  # a left-padded prompt: sdpa then gets a 4-D mask
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    state = [p.untyped_storage() for p in model.parameters()] + [p.grad.untyped_storage() for p in model.parameters()]
    with LiveBytes({id(s) for s in state}) as probe:
        logprobs, _ = response_logprobs(model, ids, mask, positions, RESPONSE, with_entropy=True, entropy_grad=False,
                                        chunked=chunked)
        advantages = torch.randn(1, RESPONSE, generator=g)
        loss, _ = ppo_policy_loss(logprobs, logprobs.detach(), advantages, torch.ones(1, RESPONSE))
        loss.backward()
    shape = ModelShape.from_model(model, find_decoder_layers(model)[0])
    x = PlanInputs(shape=shape, resident={}, compute_bytes=4, master_bytes=4, micro_batch=1, prompt_len=PROMPT,
                   response_len=RESPONSE, activation_checkpointing=checkpointing, chunked_logprobs=chunked,
                   sharded=False, padded_mask=padded)
    plan = plan_memory(x, None).update_peak - CUDA_RUNTIME_BYTES
    assert plan == pytest.approx(probe.peak, rel=0.2), (plan, probe.peak)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_sft_plan_is_within_20_percent_of_a_measured_sft_micro_batch(monkeypatch, chunked):
    """An SFT step's micro-batch (target log-probs of the answer, the mean NLL) costs what the plan's update
    phase counts for a response of the answer's length (`plan_inputs(kind="sft")` builds these inputs)."""
    import verl.algorithms.head_logprobs as head_mod
    from verl.data.datasets import IGNORE_INDEX
    from verl.trainer.offline.sft_trainer import collate_sequences, shifted_targets, target_logprobs

    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", 8192 * 64)
    model = _model(checkpointing=True)
    ids = torch.randint(0, 8192, (PROMPT + RESPONSE,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = collate_sequences([[(ids, shifted_targets([IGNORE_INDEX] * PROMPT + ids[PROMPT:]))]], 0, packed=False)
    state = [p.untyped_storage() for p in model.parameters()] + [p.grad.untyped_storage() for p in model.parameters()]
    with LiveBytes({id(s) for s in state}) as probe:
        logprobs, _ = target_logprobs(model, batch, torch.device("cpu"), chunked)
        (-logprobs.mean()).backward()
    shape = ModelShape.from_model(model, find_decoder_layers(model)[0])
    x = PlanInputs(shape=shape, resident={}, compute_bytes=4, master_bytes=4, micro_batch=1, prompt_len=PROMPT,
                   response_len=RESPONSE, activation_checkpointing=True, chunked_logprobs=chunked, sharded=False,
                   padded_mask=False, samples=False)
    plan = plan_memory(x, None).update_peak - CUDA_RUNTIME_BYTES
    assert plan == pytest.approx(probe.peak, rel=0.2), (plan, probe.peak)
