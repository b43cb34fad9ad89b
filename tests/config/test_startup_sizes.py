"""Sizes the schema cannot judge alone, refused at start-up where the model's config is known (no weights)."""

from __future__ import annotations

from types import SimpleNamespace

from verl.config import load_config
from verl.trainer.checks.host_memory import GiB, check_host_memory
from verl.trainer.checks.startup import check_startup


def _problems(tiny_path: str, tmp_path, *overrides: str) -> list[str]:
    config = load_config(None, [f"trainer.run_dir={tmp_path / 'run'}", "trainer.device=cpu", *overrides])
    return [str(p) for p in check_startup(config, world_size=1, model_path=tiny_path, device_type="cpu").problems]


def test_a_response_past_the_models_positions_is_refused_before_the_first_step(tiny_path, tmp_path) -> None:
    problems = _problems(tiny_path, tmp_path, "rollout.max_new_tokens=1e8")
    assert any("data.max_prompt_length=512 + rollout.max_new_tokens=100000000" in p and "past the 1024 positions"
               in p and "Fix: set rollout.max_new_tokens to at most 512" in p for p in problems), problems
    assert not [p for p in _problems(tiny_path, tmp_path, "rollout.max_new_tokens=512") if "positions" in p]


def test_a_cpu_step_that_cannot_fit_in_ram_is_refused_with_the_numbers_and_settings(tiny_path, tmp_path) -> None:
    problems = _problems(tiny_path, tmp_path, "rollout.n=1e9")
    memory = [p for p in problems if p.startswith("host memory")]
    assert memory and "8,000,000,000 sequences" in memory[0] and "GiB available" in memory[0]
    assert "Fix: lower rollout.n=1000000000 or data.train_batch_size=8" in memory[0]
    assert not [p for p in _problems(tiny_path, tmp_path) if p.startswith("host memory")]


def test_the_plan_compares_with_what_the_host_has() -> None:
    config = load_config(None, ["rollout.n=64", "data.train_batch_size=64"])
    cfg = SimpleNamespace(hidden_size=1024, num_hidden_layers=24, vocab_size=32000, num_attention_heads=16)
    assert check_host_memory(config, "rl", None, cfg=cfg, available=1000 * GiB) == []
    refused = check_host_memory(config, "rl", None, cfg=cfg, available=1 * GiB)
    assert refused and "this host has 1.0 GiB available" in str(refused[0])
    assert check_host_memory(config, "sft", None, cfg=cfg, available=1) == []  # RL steps only


def test_a_gpu_run_is_refused_when_its_sequences_alone_cannot_fit_on_the_host() -> None:
    """rollout.n=1e9 on a GPU run: the models live on the GPU, but the step's sequences pass through the host."""
    config = load_config(None, ["rollout.n=1e9"])
    cfg = SimpleNamespace(hidden_size=1024, num_hidden_layers=24, vocab_size=32000, num_attention_heads=16)
    refused = check_host_memory(config, "rl", None, cfg=cfg, available=64 * GiB, on_gpu=True)
    assert refused and "an RL step's sequences on a GPU run" in str(refused[0]) and "8,000,000,000 sequences" in str(
        refused[0]) and "Fix: lower rollout.n=1000000000" in str(refused[0])
    huge_model = SimpleNamespace(hidden_size=8192, num_hidden_layers=80, vocab_size=128000, num_attention_heads=64)
    sane = load_config(None, ["rollout.n=16", "data.train_batch_size=512"])
    assert check_host_memory(sane, "rl", None, cfg=huge_model, available=64 * GiB, on_gpu=True) == []  # 70B: GPU's
    assert check_host_memory(sane, "rl", None, cfg=huge_model, available=64 * GiB)  # the same on CPU: refused
