"""Tiny random decoders for rollout tests: no tokenizer, no hub."""

from __future__ import annotations

import pytest
import torch

VOCAB = 300


def make_model(arch: str = "qwen2", seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    """A random 2-layer decoder with GQA, built from a seed without touching the caller's RNG."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    config = config_cls(**common)
    if arch == "qwen3":
        config.head_dim = 16
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        # Random init with std 0.02 gives nearly flat logits and uniform attention, which would hide
        # wrong positions or masks; sharpen attention and logits so that they matter.
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.normal_(0, 0.4)
                layer.self_attn.k_proj.weight.normal_(0, 0.4)
            model.get_input_embeddings().weight.normal_(0, 0.2)
            if model.lm_head.weight is not model.get_input_embeddings().weight:
                model.lm_head.weight.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def qwen2() -> torch.nn.Module:
    return make_model("qwen2")


def left_padded(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of the given lengths, left-padded with id 0 to the longest."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    mask = (torch.arange(width) >= (width - torch.tensor(lengths)).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 0), mask
