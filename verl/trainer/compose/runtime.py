"""`TrainerRuntime`: what every trainer (RL, DPO, SFT) shares on top of its composed parts.

The parts come from `components.compose` (the checks, the process, the policy, and for RL every role);
this class holds them under the names the stages use, and adds the shared machinery: gathered weights for
generation, prompt encoding, the clipped optimizer step and the loop with checkpoints (`loop`).

A trainer subclass supplies `step()` (one update, returns metrics), `validate()`, and the state to save
(`app_state()` for models/optimizers, `trainer_state()` for small things, `schedulers()`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.distributed import tensor_parallel
from verl.distributed.fsdp import gathered
from verl.errors import VerlError
from verl.models.lora import is_peft_model
from verl.rollout.prompts import PromptCodec, Prompts
from verl.trainer.build.models import cpu_matmul_choice
from verl.trainer.build.setup import resolve_run_dir, seed_everything
from verl.trainer.checks.preflight import Given
from verl.trainer.compose import loop
from verl.trainer.compose.components import Components, compose
from verl.utils.cpu_matmul import cpu_model


class TrainerRuntime:
    kind = "base"
    runs_split_placements = False  # roles on different ranks (RLTrainer, through its Placement)

    def __init__(self, config: RunConfig, *, given: Given = Given(), parts: Components | None = None) -> None:
        """`given`: what a Python caller passed instead of the config (model, tokenizer, rows, environment,
        reward functions: each trainer's constructor takes its own names for them); the checks use them and
        check only the rest. `parts`: another trainer's composed parts to run on instead (`on_parts`)."""
        self.config = config
        if parts is None:
            self.parts: Components = compose(config, kind=self.kind, runs_split=self.runs_split_placements,
                                             given=given)
        else:
            self.parts = on_parts(parts, config, given.model)
        p = self.parts.process
        self.rank, self.world_size, self.local_rank = p.rank, p.world_size, p.local_rank
        self.device, self.dtype, self.groups, self.roles, self.split = p.device, p.dtype, p.groups, p.roles, p.split
        self.dp_rank, self.dp_size = p.dp_rank, p.dp_size
        self.generator, self.shuffle_generator = p.generator, p.shuffle_generator
        self.checks = self.parts.checks
        if self.rank == 0 and parts is None:  # what `verl check` prints as warnings: the run starts, but says so once
            for warning in self.checks.warnings:
                warnings.warn(warning.message, stacklevel=2)
        self.model, self.tokenizer = self.parts.policy, self.parts.tokenizer
        self.prompts = PromptCodec(self.tokenizer, config.data, self.parts.processor,
                                   keep_pictures=config.rollout.engine == "vllm")
        self.step_count = 0
        self.run_dir = resolve_run_dir(config, self.kind)
        self.history: list[dict[str, float]] = []
        self.validation_samples: list[dict[str, Any]] | None = None  # the last validation's, for the loop

    # ------------------------------------------------------------------ data parallelism
    def gathered(self, module: torch.nn.Module) -> AbstractContextManager[None]:
        """A sharded model's weights gathered for generation (`distributed.fsdp.gathered`)."""
        return gathered(module, self.config.fsdp.reshard_after_forward)

    # ------------------------------------------------------------------ prompts and responses
    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.tokenizer.eos_token_id
        out = [ids] if isinstance(ids, int) else list(ids or [])
        gen_cfg = getattr(self.model, "generation_config", None)
        extra = getattr(gen_cfg, "eos_token_id", None)
        for i in [extra] if isinstance(extra, int) else list(extra or []):
            if i not in out:
                out.append(i)
        return out

    def encode_prompts(self, rows: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prompts.encode(rows)

    def prompt_batch(self, rows: Sequence[Mapping[str, Any]]) -> Prompts:
        """The sampler's prompts for `rows`: ids, mask and, with a vision-language policy, each row's images."""
        return self.prompts.encode_batch(rows)

    def decode_responses(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        return self.prompts.decode(response_ids, response_mask)

    def clip_and_step(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None,
                      scheduler: Any = None) -> float:
        """Clip (when configured), refuse a non-finite gradient, step the optimizer and then its learning-rate
        `scheduler`; returns the pre-clip norm. A gradient that is exactly zero on every rank (every advantage 0,
        e.g. each GRPO group's rewards equal) carries nothing to learn, and AdamW stepping on it would still move
        every weight by its momentum and weight decay (for about ten steps after a collapse): that step is
        skipped, schedule included (warm-up and decay count optimizer steps)."""
        params = [p for p in module.parameters() if p.grad is not None]
        # Torch's clipping stacks per-gradient norms, which fails where a tensor-parallel model's DTensors of two
        # meshes (or DTensors and plain norms' weights) meet; `tensor_parallel.clip_grad_norm_` combines them.
        clip = tensor_parallel.clip_grad_norm_ if tensor_parallel.is_tensor_parallel(params) else (
            torch.nn.utils.clip_grad_norm_)
        norm = clip(params, grad_clip if grad_clip is not None else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2 gives a DTensor
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            raise VerlError(f"step {self.step_count + 1}: the gradient norm is {float(norm)}; the update was "
                            "skipped. Lower the learning rate, keep grad clipping on (actor.grad_clip) or use "
                            "float32 (model.dtype=float32)")
        if float(norm) == 0.0:  # the norm is global (FSDP: all shards), so every rank skips alike
            optimizer.zero_grad(set_to_none=True)
            return 0.0
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return float(norm)

    # ------------------------------------------------------------------ to be provided by trainers
    def step(self) -> dict[str, float]:  # pragma: no cover - abstract
        raise TypeError(f"{type(self).__name__} must implement step()")

    def validate(self) -> dict[str, float]:
        return {}

    def row_counts(self) -> tuple[int, int] | None:
        """(training rows, validation rows) for the banner, or None for a trainer without rows."""
        return None

    def app_state(self) -> dict[str, Any]:
        return {"model": self.model}

    def trainer_state(self) -> dict[str, Any]:
        return {}

    def load_trainer_state(self, state: Mapping[str, Any]) -> None:
        return None

    def schedulers(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ checkpoint state and the loop
    def _extra_state(self) -> dict[str, Any]:
        return loop.extra_state(self)

    def _restore_extra(self, extra: Mapping[str, Any]) -> None:
        loop.restore_extra(self, extra)

    def hf_assets(self) -> tuple[Any, ...]:
        """What `verl ckpt export` needs to rebuild a Hugging Face folder: config, generation config, tokenizer,
        a vision-language model's processor, and with LoRA the adapter's config (`adapter_config.json`, which
        names the base model)."""
        gen = getattr(self.model, "generation_config", None)
        adapter = self.model.peft_config["default"] if is_peft_model(self.model) else None
        assets = (self.model.config, gen, self.tokenizer, self.parts.processor, adapter)
        return tuple(a for a in assets if a is not None)

    def fit(self) -> list[dict[str, float]]:
        """Train for `trainer.total_steps` (resuming first when a checkpoint exists); returns the history."""
        return loop.fit(self)

    def _log(self, tracker: Any, metrics: dict[str, float], step: int) -> None:
        loop.log_metrics(self, tracker, metrics, step)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """`summary` as the run's summary.json. On CPU it first gets the kernels that produced it (the decode's too,
        where it chose apart), to reproduce it (in place: what a demo returns is what it wrote)."""
        path = self.run_dir / "summary.json"
        if self.device.type == "cpu":
            library, why = cpu_matmul_choice(self.config, self.model)
            summary.update(cpu_matmul=library, cpu_matmul_why=why, cpu=cpu_model())
            decode = getattr(getattr(self, "engine", None), "decode_matmul", None)  # RL, on our sampler's fast step
            if decode is not None:
                summary.update(cpu_matmul_decode=decode[0], cpu_matmul_decode_why=decode[1])
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(summary), indent=2), encoding="utf-8")
        return path


def on_parts(parts: Components, config: RunConfig, model: torch.nn.Module | None = None) -> Components:
    """A trainer on another trainer's composed parts (an RL trainer's, for the demos' SFT warm start): its
    process, role groups, tokenizer and policy, so nothing is checked, loaded or joined again and, on a split
    placement, it can run on the actor's ranks alone while the other ranks wait (a second `compose` is a
    collective of every rank, and the offline trainers refuse split placements). The RNGs are seeded as a
    composed trainer's are, so it trains exactly as one composed for itself would."""
    if "actor" not in parts.process.roles:
        raise VerlError(f"rank {parts.process.rank} holds no actor (its roles: {sorted(parts.process.roles)}), so "
                        "a trainer cannot run on its parts there. Fix: build it only on the actor's ranks "
                        "(`placement.holds('actor')`)")
    if model is not None and model is not parts.policy:
        raise VerlError("a trainer on another trainer's parts trains that trainer's policy; pass model=None "
                        "(or that policy)")
    seed_everything(config.trainer.seed)
    return parts


__all__ = ["TrainerRuntime", "on_parts"]
