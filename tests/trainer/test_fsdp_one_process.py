"""`fsdp.*` in a launch without torchrun (`verl train cfg`, `--nproc 1`): applied to the models, not
dropped, and `verl check` says what each option does in this launch."""

import torch
import torch.distributed as dist
from rl_support import rl_config
from torch.distributed.fsdp import FSDPModule

from verl.cli.main import main
from verl.demos.arithmetic import demo_config_path
from verl.distributed.fsdp import find_decoder_layers
from verl.distributed.process import shutdown_distributed
from verl.trainer.compose.components import compose
from verl.trainer.rl_trainer import RLTrainer


def test_one_process_run_applies_mixed_precision_and_activation_checkpointing(tmp_path):
    config = rl_config(tmp_path / "run", "fsdp.mixed_precision=true", "fsdp.activation_checkpointing=true",
                       "trainer.total_steps=1", "actor.kl_loss_coef=0.01", "trainer.cpu_threads=1")
    assert not dist.is_initialized()
    try:
        trainer = RLTrainer(config)
        layers = find_decoder_layers(trainer.model)
        seen: list[torch.dtype] = []
        layers[0].register_forward_hook(
            lambda mod, args, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype)
            if torch.is_grad_enabled() else None)
        trainer.fit()
        assert dist.is_initialized() and dist.get_world_size() == 1  # a 1-rank group of its own
        assert isinstance(trainer.model, FSDPModule)
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # float32 master weights
        assert seen and set(seen) == {torch.bfloat16}  # the training forward computes in bfloat16
        assert [getattr(layer, "_verl_checkpointed", False) for layer in layers] == [True, True]
        assert isinstance(trainer.ref_model, FSDPModule)  # the reference is sharded like the actor
        assert trainer.history[-1]["actor/grad_norm"] > 0
    finally:
        shutdown_distributed()


def test_activation_checkpointing_alone_needs_no_process_group(tmp_path):
    config = rl_config(tmp_path / "run", "fsdp.activation_checkpointing=true")
    parts = compose(config, kind="rl")
    assert not dist.is_initialized() and not isinstance(parts.policy, FSDPModule)
    assert all(getattr(layer, "_verl_checkpointed", False) for layer in find_decoder_layers(parts.policy))


def test_verl_check_says_what_each_fsdp_option_does_in_this_launch(capsys):
    assert main(["check", demo_config_path(), "fsdp.mixed_precision=true", "fsdp.activation_checkpointing=true",
                 "fsdp.cpu_offload=true"]) == 0
    out = capsys.readouterr().out
    assert ("note: fsdp in this launch: one process without torchrun joins a 1-rank process group of its own so "
            "FSDP2 applies the options below") in out
    assert ("note: fsdp.mixed_precision=true: applied; float32 master weights and optimizer states, bfloat16 "
            "compute, float32 gradient reductions") in out
    assert "note: fsdp.activation_checkpointing=true: applied per decoder layer, by FSDP2's wrapping" in out
    assert "note: fsdp.cpu_offload=true: no effect on CPU" in out
    assert main(["check", demo_config_path()]) == 0
    out = capsys.readouterr().out
    assert "note: fsdp in this launch: one process, no FSDP2 wrapping (no option below needs it)" in out
    assert "note: fsdp.mixed_precision=auto: off; trained weights in float32, computed in float32" in out
