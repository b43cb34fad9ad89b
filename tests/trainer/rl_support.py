"""Shared helpers for the RL trainer tests: small configs on the tiny model, metrics, weight snapshots.

Imported by tests/trainer/test_rl_*.py (pytest puts this folder on sys.path). The tiny model runs ~30x
faster with one intra-op thread on a busy 2-core machine, so the tests pin torch to one thread.

This file is also a reward module (`DIGIT_REWARD_SPEC`, loaded by its path in `verl train` processes that do
not have tests/ on sys.path), so it imports the shared test helpers (tests/tiny_support.py) where they are used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verl.config import load_config
from verl.config.schema import RunConfig

HERE = Path(__file__).resolve().parent

# Documented metric keys (docs: RL metrics); every step of every estimator writes these.
BASE_KEYS = {
    "reward/mean", "reward/std", "reward/zero_std_group_frac",
    "actor/pg_loss", "actor/entropy", "actor/clipfrac", "actor/approx_kl", "actor/grad_norm", "actor/lr",
    "response/length_mean", "response/length_max", "response/truncation_ratio",
    "timing/generate", "timing/reward", "timing/advantages", "timing/update", "timing/step",
    "perf/tokens_per_s",
}
CRITIC_KEYS = {"critic/vf_loss", "critic/explained_var", "critic/grad_norm", "critic/lr", "timing/critic",
               "timing/update_critic"}


def digit_reward(prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
    """Fraction of the response's characters that are digits: dense, varied within a group, learnable."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


DIGIT_REWARD_SPEC = {"name": f"{HERE / 'rl_support.py'}:digit_reward"}


def base_overrides(run_dir: Path | str) -> list[str]:
    """The tiny RL run (tests/tiny_support.py) on arithmetic prompts, 4 prompts x 4 samples of 4 tokens."""
    from tiny_support import tiny_overrides

    return [
        *tiny_overrides(run_dir),
        "env.name=arithmetic", "env.kwargs.max_operand=9", "env.kwargs.num_val=16",
        "data.train_batch_size=4", "rollout.n=4", "rollout.max_new_tokens=4",
        "actor.lr=1e-3", "critic.lr=1e-3",
    ]


def rl_config(run_dir: Path | str, *overrides: str, reward: dict[str, Any] | None = DIGIT_REWARD_SPEC) -> RunConfig:
    """A config for the tiny model on arithmetic prompts, scored by `reward` (digit_reward by default,
    so that groups have non-zero advantages and every parameter gets a gradient)."""
    config = load_config(overrides=[*base_overrides(run_dir), *overrides])
    if reward is not None:
        config.reward.functions = [dict(reward)]
    return config


def captured_update(trainer: Any, module: torch.nn.Module, update: Any,
                    batch: Any) -> tuple[dict[str, torch.Tensor], Any, int]:
    """Run `update(batch)` (e.g. `trainer.update_policy`) with the optimizer step replaced by a capture of
    the accumulated gradients: (gradient per parameter name, what `update` returned, `module`'s forwards)."""
    captured: dict[str, torch.Tensor] = {}
    forwards = []

    def capture(stepped: torch.nn.Module, optimizer: Any, clip: Any, scheduler: Any) -> float:
        captured.update({n: p.grad.detach().clone() for n, p in stepped.named_parameters() if p.grad is not None})
        return 1.0

    trainer.clip_and_step = capture
    hook = module.register_forward_hook(lambda *a: forwards.append(1))
    try:
        result = update(batch)
    finally:
        hook.remove()
    return captured, result, len(forwards)


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> dict[str, bool]:
    return {name: not torch.equal(before[name], p.detach()) for name, p in module.named_parameters()}


def deterministic_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metric rows without wall-clock keys (timing/*, perf/*), for exact comparisons."""
    return [{k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))} for row in rows]


def state_tensors(trainer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight and optimizer tensor of a trainer (actor, critic, their AdamW moments)."""
    modules = {"model": trainer.model, "critic": getattr(trainer, "critic", None)}
    for prefix, module in modules.items():
        if module is None:
            continue
        for name, tensor in module.state_dict().items():
            yield f"{prefix}.{name}", tensor
    optimizers = {"optimizer": trainer.optimizer, "critic_optimizer": getattr(trainer, "critic_optimizer", None)}
    for prefix, opt in optimizers.items():
        if opt is None:
            continue
        for pid, st in opt.state_dict()["state"].items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    yield f"{prefix}.{pid}.{key}", value


def batch_of_lengths(lengths, prompt_mask=(0, 0, 0, 1, 1), width=10):
    """A RolloutBatch of one sequence per length: a prompt of `prompt_mask` (2 tokens left-padded to 5) and a
    response of that many tokens (right-padded to `width`), for micro-batch grouping."""
    from verl.batch import RolloutBatch

    n = len(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return RolloutBatch(rows=[{} for _ in lengths], group_ids=torch.arange(n),
                        prompt_ids=torch.ones(n, len(prompt_mask), dtype=torch.long),
                        prompt_mask=torch.tensor([list(prompt_mask)] * n), response_ids=mask.clone(),
                        response_mask=mask, advantages=torch.ones(n, width))


def random_groups(groups=3, n=4, prompt=7, response=6, seed=0):
    """`groups` left-padded prompts (the first one full-length), each repeated `n` times, with right-padded
    responses of random lengths, and random per-token weights on the real response tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, prompt + 1, (groups,), generator=g)
    lengths[0] = prompt
    prompt_mask = (torch.arange(prompt)[None] >= (prompt - lengths)[:, None]).long()
    prompt_ids = torch.randint(3, 700, (groups, prompt), generator=g) * prompt_mask
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
    r_len = torch.randint(1, response + 1, (groups * n,), generator=g)
    response_mask = (torch.arange(response)[None] < r_len[:, None]).long()
    response_ids = torch.randint(3, 700, (groups * n, response), generator=g) * response_mask
    weights = torch.randn(groups * n, response, generator=g, dtype=torch.float64) * response_mask
    return prompt_ids, prompt_mask, response_ids, response_mask, weights


class LargestVocabTensor(TorchDispatchMode):
    """Rows of the largest new tensor (not a view of an input, such as the head weight's transpose) with a
    vocabulary-sized last dimension that any operation returns."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab
                    and t.untyped_storage().data_ptr() not in inputs):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out
