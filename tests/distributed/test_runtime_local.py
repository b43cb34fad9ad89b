"""Single-process behaviour of the runtime and FSDP helpers (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verl.config.fsdp import FSDPConfig
from verl.distributed import CollectiveGuard, RoleGroups, init_distributed
from verl.distributed.fsdp import apply_fsdp, enable_activation_checkpointing, find_decoder_layers
from verl.distributed.mapping import validate_device_mapping
from verl.distributed.transfer import shard_batch
from verl.errors import ConfigError, DeviceMappingError, DistributedError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, scale=0.5)
        return self.head(h)


def grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_keeps_names_and_gradients():
    torch.manual_seed(0)
    plain, ckpt = Net().double(), Net().double()
    ckpt.load_state_dict(plain.state_dict())
    layers = find_decoder_layers(ckpt)
    assert layers == list(ckpt.layers)
    enable_activation_checkpointing(layers)
    enable_activation_checkpointing(layers)  # idempotent: no double wrapping
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64)
    g_plain, g_ckpt = grads(plain, x), grads(ckpt, x)
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=0, atol=0)
    with torch.no_grad():  # inference path skips recomputation
        torch.testing.assert_close(ckpt(x), plain(x))


def test_hf_decoder_layers_are_found_by_no_split_modules():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    layers = find_decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["Qwen2DecoderLayer", "Qwen2DecoderLayer"]


def test_apply_fsdp_error_paths():
    with pytest.raises(ConfigError, match="needs a 2-D mesh whose groups exist on every rank"):
        apply_fsdp(Net(), FSDPConfig(sharding_strategy="HYBRID_SHARD"))
    with pytest.raises(DistributedError, match="needs an initialised process group"):
        apply_fsdp(Net(), FSDPConfig(), device_type="cpu")
    with pytest.raises(ConfigError, match="no decoder layers to checkpoint"):
        apply_fsdp(nn.Linear(2, 2), FSDPConfig(activation_checkpointing=True), mesh=object(), layers=[])


def test_init_distributed_without_torchrun_is_single_process(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed(timeout_s=5)
    assert (env.rank, env.world_size, env.backend, env.is_distributed) == (0, 1, None, False)


def test_init_distributed_with_partial_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(DistributedError) as info:
        init_distributed(timeout_s=5)
    assert "WORLD_SIZE=2 is set but MASTER_ADDR, MASTER_PORT is not" in str(info.value)
    assert "torchrun --nproc_per_node=N" in str(info.value)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DistributedError, match="WORLD_SIZE='two' is not an integer"):
        init_distributed()


def test_single_process_role_groups_pass_batches_through():
    mapping = validate_device_mapping(
        None,
        world_size=1,
        algorithm_needs_critic=True,
        needs_ref=True,
        needs_reward_model=False,
        role_dtypes={"actor": "float32", "critic": "float32", "ref": "float32"},
        visible_devices=None,
        cuda_visible_devices=None,
    )
    groups = RoleGroups.create(mapping, timeout_s=5)
    batch = {"x": torch.arange(6).view(3, 2)}
    assert groups.move_batch(batch, "actor", "critic", stage="values") is batch
    assert groups.has("ref") and not groups.has("reward")
    t = torch.ones(2)
    assert groups.all_reduce(t, "actor", stage="s") is t and torch.equal(t, torch.ones(2))
    CollectiveGuard(1).arrive("alone", (0,))  # a group of one never waits


def test_role_groups_reject_a_mapping_for_another_world():
    mapping = validate_device_mapping(
        None,
        world_size=2,
        algorithm_needs_critic=False,
        needs_ref=False,
        needs_reward_model=False,
        role_dtypes={},
        visible_devices=None,
        cuda_visible_devices=None,
    )
    with pytest.raises(DeviceMappingError, match="validated for world size 2 but 1 process"):
        RoleGroups.create(mapping)


def test_shard_batch_is_contiguous_and_covers_everything():
    batch = {"x": torch.arange(7), "y": torch.arange(14).view(7, 2)}
    parts = [shard_batch(batch, i, 3) for i in range(3)]
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert torch.equal(torch.cat([p["y"] for p in parts]), batch["y"])
