"""The offload switches: `actor/critic.cpu_offload` (FSDP2 CPUOffloadPolicy per role, default
`fsdp.cpu_offload`) and `actor/critic.activation_offload` (`torch.autograd.graph.save_on_cpu` around each
micro-batch's forward). Activation offload moves tensors only on a GPU; here it is forced onto CPU tensors,
where save_on_cpu copies every saved tensor all the same, and the update's gradients must not change by a
bit (with checkpointing, chunked log-probs and an entropy bonus in the graph)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from rl_support import captured_update, rl_config

import verl.trainer.rl.update as update_mod
from verl.distributed.offload import activations_offloaded, offloads_activations
from verl.trainer.build.fsdp_launch import fsdp_launch


def test_cpu_offload_per_role_defaults_to_fsdp_cpu_offload(tmp_path):
    config = rl_config(tmp_path)
    assert not config.offloads("actor") and not config.offloads("critic")
    config = rl_config(tmp_path, "fsdp.cpu_offload=true", "critic.cpu_offload=false")
    assert config.offloads("actor") and not config.offloads("critic") and config.offloads("ref")
    config = rl_config(tmp_path, "actor.cpu_offload=true")
    assert config.offloads("actor") and not config.offloads("critic") and not config.offloads("ref")


def test_what_each_switch_does_on_this_launch(tmp_path):
    config = rl_config(tmp_path, "actor.cpu_offload=true", "actor.activation_offload=true",
                       "critic.activation_offload=true")
    on_gpu = fsdp_launch(config, world_size=2, device_type="cuda", torchrun=True, bf16_supported=True)
    assert on_gpu.offload and on_gpu.sharded
    assert ("actor.cpu_offload=true: the actor's sharded parameters, gradients and optimizer states live on the CPU"
            in on_gpu.lines)
    assert ("actor.activation_offload=true: applied: the tensors its forward saves for backward wait in pinned "
            "host memory") in on_gpu.lines
    one_gpu = fsdp_launch(config.model_copy(update={"fsdp": config.fsdp.model_copy(update={"mixed_precision": False})}),
                          world_size=1, device_type="cuda", torchrun=False, bf16_supported=True)
    assert one_gpu.own_group  # FSDP2 on a 1-rank group of its own, so the actor's offload applies
    on_cpu = fsdp_launch(config, world_size=1, device_type="cpu", torchrun=False)
    assert not on_cpu.own_group and "actor.cpu_offload=true: no effect on CPU" in on_cpu.lines
    assert ("critic.activation_offload=true: no effect on CPU (activations already live in host memory)"
            in on_cpu.lines)


def test_activation_offload_applies_on_a_gpu_only():
    assert not offloads_activations(True, torch.device("cpu")) and not offloads_activations(False, torch.device("cuda"))
    assert isinstance(activations_offloaded(True, torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(activations_offloaded(True, torch.device("cuda")), torch.autograd.graph.save_on_cpu)


@pytest.mark.parametrize("extra", [(), ("fsdp.activation_checkpointing=true", "actor.share_prompt_forward=false")])
def test_activation_offload_leaves_the_update_gradients_unchanged(tmp_path, monkeypatch, extra):
    from verl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer(rl_config(tmp_path, "actor.entropy_coef=0.01", "actor.kl_loss_coef=0.1",
                                  "trainer.total_steps=1", "rollout.max_new_tokens=6", "actor.micro_batch_size=4",
                                  "actor.shuffle=false", "actor.chunked_logprobs=true", *extra))
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    batch = trainer.compute_advantages(trainer.compute_ref_log_probs(trainer.compute_log_probs(batch)))
    want, want_metrics, _ = captured_update(trainer, trainer.model, trainer.update_policy, batch)

    packed: list[int] = []

    class Counted(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool) -> None:
            super().__init__(pin_memory=pin_memory)
            pack = self.pack_hook
            self.pack_hook = lambda t: (packed.append(t.numel()), pack(t))[1]

    def as_on_a_gpu(enabled: bool, device: torch.device):  # what the switch gives on a GPU, on CPU tensors
        return Counted(pin_memory=False) if enabled else contextlib.nullcontext()

    monkeypatch.setattr(update_mod, "activations_offloaded", as_on_a_gpu)
    trainer.config.actor.activation_offload = True
    got, got_metrics, _ = captured_update(trainer, trainer.model, trainer.update_policy, batch)
    assert packed  # the forward's saved tensors went through the offload
    assert got_metrics["actor/pg_loss"] == want_metrics["actor/pg_loss"]
    assert set(got) == set(want)
    for name, g in want.items():
        assert torch.equal(got[name], g), name
    packed.clear()
    trainer.config.actor.activation_offload = False
    captured_update(trainer, trainer.model, trainer.update_policy, batch)
    assert not packed  # off: nothing is offloaded


def test_each_role_is_sharded_with_its_own_offload_switch(tmp_path, monkeypatch):
    import types

    import verl.trainer.compose.components as components

    applied = {}
    monkeypatch.setattr(components, "apply_fsdp", lambda module, cfg, **kw: applied.setdefault(module, cfg))
    groups = types.SimpleNamespace(ranks=lambda role: [0, 1], mesh=lambda role, device: None,
                                   tensor_parallel_mesh=lambda device: None)
    process = types.SimpleNamespace(groups=groups, device=torch.device("cpu"))
    config = rl_config(tmp_path, "fsdp.cpu_offload=false", "critic.cpu_offload=true")
    actor, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    components.shard(actor, "actor", config, process)
    components.shard(critic, "critic", config, process)
    assert applied[actor].cpu_offload is False and applied[critic].cpu_offload is True
    assert config.fsdp.cpu_offload is False  # the run's own section is left as it was
