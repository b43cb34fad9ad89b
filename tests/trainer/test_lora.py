"""LoRA end to end: RL, DPO and SFT with peft adapters, the reference as the policy with its adapters off,
the sampler on the adapted weights, adapter-only checkpoints with exact resume, and both exports."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rl_support import deterministic_rows, read_metrics, rl_config, state_tensors
from tiny_support import load_tiny, tiny_config, tiny_tree
from transformers import AutoModelForCausalLM

from verl.checkpoint import TrainingInterrupted, export_hf, list_checkpoints, verify
from verl.config.loader import apply_overrides, build_config
from verl.models.lora import AdapterOff, base_of, is_peft_model
from verl.trainer.forward.logprobs import response_logprobs
from verl.trainer.offline.dpo_trainer import DPOTrainer
from verl.trainer.offline.sft_trainer import SFTTrainer
from verl.trainer.rl_trainer import RLTrainer

peft = pytest.importorskip("peft")

LORA = ("model.lora.rank=8", "actor.kl_loss_coef=0.1", "actor.lr=2e-2")


def base_model(trainer) -> torch.nn.Module:
    """The untouched base weights, loaded again from the model's folder."""
    return AutoModelForCausalLM.from_pretrained(trainer.checks.model_path, dtype=torch.float32).eval()


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An RL run with LoRA rank 8 and a KL loss (so the reference runs), 3 steps, a checkpoint at the end."""
    run = tmp_path_factory.mktemp("lora") / "run"
    trainer = RLTrainer(rl_config(run, *LORA, "trainer.total_steps=3"))
    frozen_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.fit()
    return trainer, frozen_before, run


def test_rl_trains_adapters_only_and_the_reference_is_the_policy_with_adapters_off(trained):
    trainer, frozen_before, _ = trained
    assert is_peft_model(trainer.model)
    assert isinstance(trainer.ref_model, AdapterOff) and trainer.ref_model.policy is trainer.model
    assert list(trainer.ref_model.parameters()) == []  # no second copy of the weights
    assert base_of(trainer.ref_model) is base_of(trainer.model)  # so the reference pass keeps `logits_to_keep`
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before, after[n]) for n, before in frozen_before.items())  # base weights never move
    assert any(after[n].abs().max() > 0 for n in trainable if "lora_B" in n)  # B starts at 0: it learned
    assert all(r["actor/ref_kl"] != 0 for r in trainer.history[1:])

    # reference log-probs = the base model's, computed without adapters
    batch = trainer.generate(trainer.get_batch())
    ref = trainer.compute_ref_log_probs(batch).ref_logprobs
    base = base_model(trainer)
    expected = response_logprobs(base, batch.input_ids, batch.attention_mask, batch.position_ids,
                                 batch.response_ids.shape[1], temperature=trainer.config.rollout.temperature)[0]
    mask = batch.response_mask.bool()
    assert torch.allclose(ref[mask], expected[mask], atol=1e-5)
    policy = trainer.sequence_logprobs(trainer.model, batch)
    assert (policy[mask] - ref[mask]).abs().max() > 1e-3  # the adapters change the policy


def test_sampler_logprobs_equal_the_training_forward_after_updates(trained):
    trainer, _, _ = trained
    batch = trainer.get_batch()
    n = trainer.config.rollout.n
    out = trainer.engine.generate(batch.prompt_ids[::n], batch.prompt_mask[::n], trainer.sampling,
                                  generator=trainer.generator)
    batch.prompt_ids, batch.prompt_mask = out.prompt_ids, out.prompt_mask.long()
    batch.response_ids, batch.response_mask = out.response_ids, out.response_mask.long()
    trained_logprobs = trainer.sequence_logprobs(trainer.model, batch)
    mask = batch.response_mask.bool()
    assert mask.sum() > 0
    assert torch.allclose(out.logprobs[mask], trained_logprobs[mask], atol=1e-5)
    with trainer.model.disable_adapter():  # and they are the adapted model's, not the base model's
        base_logprobs = trainer.sequence_logprobs(trainer.model, batch)
    assert (out.logprobs[mask] - base_logprobs[mask]).abs().max() > 1e-3


def test_export_merged_and_adapter_reload_with_the_trainers_logits(trained, tmp_path):
    trainer, _, run = trained
    step = run / "checkpoints" / "step_3"
    assert verify(step) == []
    ids = trainer.get_batch().prompt_ids[:4]
    ids = ids.masked_fill(ids == trainer.tokenizer.pad_token_id, 1)
    trainer.model.eval()
    expected = logits(trainer.model, ids)

    merged = export_hf(step, tmp_path / "merged")
    assert not (merged / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    assert not is_peft_model(plain)
    assert torch.allclose(logits(plain, ids), expected, atol=1e-5)

    adapter = export_hf(step, tmp_path / "adapter", adapter=True)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert not (adapter / "config.json").exists()
    reloaded = peft.PeftModel.from_pretrained(base_model(trainer), str(adapter))
    assert torch.allclose(logits(reloaded, ids), expected, atol=1e-5)
    # the adapter is a starting point for another run: model.lora.path
    again = RLTrainer(rl_config(tmp_path / "again", *LORA, f"model.lora.path={adapter}", "model.lora.rank=0",
                                "trainer.total_steps=1"))
    again.model.eval()
    assert torch.allclose(logits(again.model, ids), expected, atol=1e-5)
    assert isinstance(again.ref_model, AdapterOff)


def test_export_cli_both_ways(trained, tmp_path, capsys):
    from verl.cli.main import main

    _, _, run = trained
    step = run / "checkpoints" / "step_3"
    assert main(["ckpt", "export", str(step), "--out", str(tmp_path / "a"), "--adapter"]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    assert (tmp_path / "a" / "adapter_model.safetensors").is_file()
    assert main(["ckpt", "export", str(step), "--out", str(tmp_path / "m")]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert main(["ckpt", "verify", str(step)]) == 0 and "OK" in capsys.readouterr().out


def test_export_errors(trained, tmp_path):
    from verl.errors import CheckpointError

    _, _, run = trained
    step = run / "checkpoints" / "step_3"
    with pytest.raises(CheckpointError) as info:
        export_hf(step, tmp_path / "x", base=tmp_path / "nowhere")
    assert "cannot be loaded" in str(info.value) and "--base DIR" in str(info.value)
    full = RLTrainer(rl_config(tmp_path / "full", "trainer.total_steps=1"))
    full.fit()
    with pytest.raises(CheckpointError) as info:
        export_hf(tmp_path / "full" / "checkpoints" / "step_1", tmp_path / "y", adapter=True)
    assert "holds full weights" in str(info.value) and "without --adapter" in str(info.value)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


SFT_ROWS = [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(4) for b in range(4)]


def sft_config(run_dir, *overrides, model="tiny:qwen2:256:2"):
    tree = tiny_tree(run_dir, "sft", {"model": {"path": model}, "trainer": {"total_steps": 2, "resume": "never"},
                                      "sft": {"batch_size": 4, "lr": 1e-2}, "actor": {"micro_batch_size": 4},
                                      "data": {"max_prompt_length": 16, "max_response_length": 8}})
    apply_overrides(tree, list(overrides))
    return build_config(tree)


def test_adapter_checkpoint_is_under_a_tenth_of_a_full_one(tmp_path):
    # The tiny model at hidden size 256 (2 layers): at the default 64, a rank-8 adapter on every linear
    # layer is itself 11.5% of the weights (the 768 x 64 embedding is most of the model), so no adapter
    # checkpoint could be under 10% there; the folder also carries fixed costs (tokenizer, RNG state).
    full = SFTTrainer(sft_config(tmp_path / "full"), train_rows=SFT_ROWS)
    full.fit()
    lora = SFTTrainer(sft_config(tmp_path / "lora", "model.lora.rank=8"), train_rows=SFT_ROWS)
    lora.fit()
    full_step, lora_step = (tmp_path / d / "checkpoints" / "step_2" for d in ("full", "lora"))
    assert verify(full_step) == [] and verify(lora_step) == []
    ratio = _dir_bytes(lora_step) / _dir_bytes(full_step)
    assert ratio < 0.10, ratio
    from verl.checkpoint.dcp_io import read_metadata_safely

    keys = read_metadata_safely(lora_step / "state" / ".metadata").state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)  # the adapter and its optimizer state only
    assert any(k.startswith("optimizer.state.") and "lora_A" in k for k in keys)
    assert not any("base_layer" in k or "embed_tokens" in k for k in keys)


def test_sft_with_lora_learns_with_the_base_frozen(tmp_path):
    trainer = SFTTrainer(sft_config(tmp_path / "run", "model.lora.rank=8", "trainer.total_steps=4", model="tiny"),
                         train_rows=SFT_ROWS)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    history = trainer.fit()
    losses = [r["loss"] for r in history if "loss" in r]
    assert losses[-1] < losses[0]
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(v, params[n]) for n, v in frozen.items())


DPO_ROWS = [{"prompt": f"What is {a}+{b}?", "chosen": f" {a + b}", "rejected": f" {(a + b + 3) % 10}"}
            for a in range(4) for b in range(4)]


def dpo_config(run_dir, **dpo):
    return tiny_config(run_dir, "dpo", {"model": {"lora": {"rank": 8}},
                                        "trainer": {"total_steps": 3, "resume": "never"},
                                        "dpo": {"lr": 2e-2, "beta": 0.1, **dpo}, "actor": {"micro_batch_size": 8},
                                        "data": {"train_batch_size": 8, "max_prompt_length": 32,
                                                 "max_response_length": 8}})


def test_dpo_with_lora_uses_the_policy_with_adapters_off_as_reference(tmp_path):
    trainer = DPOTrainer(dpo_config(tmp_path / "a"), train_rows=DPO_ROWS)
    assert isinstance(trainer.ref_model, AdapterOff) and list(trainer.ref_model.parameters()) == []
    history = trainer.fit()
    assert history[-1]["loss"] < history[0]["loss"]
    # after training the reference still scores as the base model does
    items = [trainer.train_data[i] for i in range(4)]
    batch = trainer.pair_batch(items)
    with torch.no_grad():
        ref = trainer.sequence_logps(trainer.ref_model, batch)
        base = trainer.sequence_logps(base_model(trainer), batch)
        policy = trainer.sequence_logps(trainer.model, batch)
    assert torch.allclose(ref, base, atol=1e-5)
    assert (policy - ref).abs().max() > 1e-3
    # precomputing the reference gives the same run (both are the base model's log-probs)
    pre = DPOTrainer(dpo_config(tmp_path / "b", precompute_ref=True), train_rows=DPO_ROWS)
    assert pre.ref_model is None
    pre_history = pre.fit()
    assert pre_history[0]["loss"] == pytest.approx(history[0]["loss"], abs=1e-5)


class Preempted(RLTrainer):
    """Receives SIGTERM (as from a scheduler) during step 2: saves that step and stops."""

    def step(self) -> dict[str, float]:
        if self.step_count + 1 == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step()


def test_resume_with_lora_is_bit_exact(tmp_path):
    overrides = (*LORA, "trainer.total_steps=3", "checkpoint.save_interval=1", "actor.ppo_epochs=2",
                 "actor.mini_batch_size=2", "actor.lr_schedule=cosine")
    straight = RLTrainer(rl_config(tmp_path / "straight", *overrides))
    straight.fit()
    first = Preempted(rl_config(tmp_path / "resumed", *overrides))
    with pytest.raises(TrainingInterrupted):  # saved, then says so
        first.fit()
    assert first.step_count == 2 and [c.step for c in list_checkpoints(tmp_path / "resumed")] == [1, 2]
    second = RLTrainer(rl_config(tmp_path / "resumed", *overrides, "trainer.resume=auto"))
    second.fit()
    assert second.step_count == 3
    got, expected = read_metrics(tmp_path / "resumed"), read_metrics(tmp_path / "straight")
    assert deterministic_rows(got) == deterministic_rows(expected)
    a, b = dict(state_tensors(straight)), dict(state_tensors(second))
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert not [k for k in a if not torch.equal(a[k], b[k])]


def test_ppo_critic_with_lora_trains_adapters_and_the_value_head(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path / "run", "model.lora.rank=4", "algorithm.adv_estimator=gae",
                                  "critic.lora.rank=4", "trainer.total_steps=1"))
    trainable = {n for n, p in trainer.critic.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    assert {"value_head.weight", "value_head.bias"} <= trainable
    history = trainer.fit()
    assert history[-1]["critic/grad_norm"] > 0
    from verl.checkpoint.dcp_io import read_metadata_safely

    keys = read_metadata_safely(tmp_path / "run" / "checkpoints" / "step_1" / "state" / ".metadata").state_dict_metadata
    critic_keys = [k for k in keys if k.startswith("critic.")]
    assert critic_keys and all("lora_" in k or "value_head" in k for k in critic_keys)


def test_a_given_model_object_gets_its_adapters_once(tmp_path):
    model, tok = load_tiny()
    trainer = SFTTrainer(sft_config(tmp_path / "run", "model.lora.rank=4", model="tiny"), model=copy.deepcopy(model),
                         tokenizer=tok, train_rows=SFT_ROWS)
    assert is_peft_model(trainer.model)
    assert sum("lora_A" in n for n, _ in base_of(trainer.model).named_parameters()) == 14  # 7 linears x 2 layers


def test_importing_verl_never_imports_peft():
    code = ("import sys, verl, verl.trainer.rl_trainer, verl.trainer.offline.dpo_trainer, verl.cli.main; "
            "print('peft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_lora_without_peft_fails_with_the_install_hint(tmp_path, monkeypatch):
    from verl.errors import ConfigError
    from verl.models.lora import require_peft

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(ConfigError) as info:
        RLTrainer(rl_config(tmp_path / "run", *LORA, "trainer.total_steps=1"))
    message = str(info.value)
    assert "the `peft` package is not installed" in message
    assert "pip install peft" in message and "pip install -e '.[peft]'" in message
    assert "verl[peft]" not in message.replace("-e '.[peft]'", "")
    with pytest.raises(ConfigError, match="model.lora: LoRA is on, but the `peft` package is not installed"):
        require_peft()


def test_metrics_file_is_written(trained):
    _, _, run = trained
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]


def test_lora_with_gradient_checkpointing_still_gets_gradients(tmp_path):
    trainer = SFTTrainer(sft_config(tmp_path / "run", "model.lora.rank=4", "model.gradient_checkpointing=true",
                                    "trainer.total_steps=1", model="tiny"), train_rows=SFT_ROWS)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}  # A has no
    # gradient while B is still 0
    history = trainer.fit()
    assert history[-1]["grad_norm"] > 0
    params = dict(trainer.model.named_parameters())
    assert all(not torch.equal(v, params[n]) for n, v in before.items())  # every layer's adapter learned
