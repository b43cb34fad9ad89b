"""`TrainerRuntime`: the composition point every trainer (RL, DPO, SFT) subclasses.

Each job lives in its own module and this class only wires them together: the start-up pass with every
check and the model/data loading (`preflight`), process set-up (`setup`), the policy and reference
(`models`), the train/val rows (`data_split`) and the loop with checkpoints (`loop`).

A trainer subclass supplies `step()` (one update, returns metrics), `validate()`, and the state to save
(`app_state()` for models/optimizers, `trainer_state()` for small things, `schedulers()`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from verl.config.schema import RunConfig
from verl.data import PromptDataset
from verl.distributed.fsdp import apply_fsdp
from verl.env import build_env
from verl.errors import VerlError
from verl.models.lora import base_of, is_peft_model
from verl.trainer import loop
from verl.trainer.data_split import read_rows, split_train_val
from verl.trainer.models import given_policy, load_policy_with_report, resolve_model_path, with_cpu_matmul
from verl.trainer.preflight import Given, Preflight, preflight
from verl.trainer.reward_model import build_reward_model_function
from verl.trainer.setup import (
    ProcessIdentity,
    ProcessSetup,
    resolve_device,
    resolve_run_dir,
    run_dtype,
    setup_process,
)
from verl.trainer.startup import StartupReport


class TrainerRuntime:
    kind = "base"
    runs_split_placements = False  # roles on different ranks (RLTrainer, through its Placement)

    def __init__(self, config: RunConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 rows: Any = None, val_rows: Any = None, env: Any = None, reward_functions: Any = None) -> None:
        """`model`, `tokenizer`, `rows`, `val_rows`, `env` and `reward_functions` are what a Python caller
        passes instead of the config; the start-up pass uses them and checks only the rest."""
        self.config = config
        identity = ProcessIdentity.from_env()
        self.rank, self.world_size, self.local_rank = identity.rank, identity.world_size, identity.local_rank
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self.device = resolve_device(config.trainer.device, self.local_rank)
        if config.trainer.cpu_threads is not None:
            torch.set_num_threads(config.trainer.cpu_threads)
        self.groups = None
        self.roles: set[str] = set()
        self.split = False
        given = Given(model=model, tokenizer=tokenizer, rows=rows is not None, val_rows=val_rows is not None,
                      env=env is not None, reward_functions=reward_functions is not None)
        # The same pass as `verl check`: weight-free checks, then (once they pass, and after joining the
        # process group) the model, data and environment, which the trainer then uses as they are.
        self.preflight: Preflight = preflight(config, world_size=self.world_size, device_type=self.device.type,
                                              kind=self.kind, runs_split_placements=self.runs_split_placements,
                                              given=given,
                                              prepare=lambda startup: self._set_up(startup, identity))
        self.startup: StartupReport = self.preflight.startup
        self.preflight.raise_if_problems()
        if self.rank == 0:  # what `verl check` prints as warnings: the run starts, but says so once
            for warning in self.preflight.warnings:
                warnings.warn(warning.message, stacklevel=2)
        self.step_count = 0
        self.run_dir = resolve_run_dir(config, self.kind)
        self.history: list[dict[str, float]] = []

    def _set_up(self, startup: StartupReport, identity: ProcessIdentity) -> tuple[torch.device, torch.dtype]:
        """Join the process group, seed, and take on the process's roles (`setup.setup_process`)."""
        setup: ProcessSetup = setup_process(self.config, startup.mapping, identity, self.device)
        self.device, self.dtype, self.groups = setup.device, setup.dtype, setup.groups
        self.roles, self.split = setup.roles, setup.split
        self.dp_rank, self.dp_size = setup.dp_rank, setup.dp_size
        self.generator, self.shuffle_generator = setup.generator, setup.shuffle_generator
        return self.device, self.dtype

    @property
    def remote_reward_model(self) -> bool:
        """A reward model placed on ranks of its own (devices.reward apart from the actor's ranks)."""
        mapping = self.startup.mapping
        return (self.split and bool(self.config.reward.model_path) and self.config.devices.reward is not None
                and mapping.ranks("reward") != mapping.ranks("actor"))

    # ------------------------------------------------------------------ data parallelism
    def shard(self, module: torch.nn.Module, role: str) -> torch.nn.Module:
        """FSDP2-shard a trainable model over its role's ranks (a no-op in one process)."""
        if self.groups is None or isinstance(base_of(module), FSDPModule):  # one process, or sharded already
            return module
        # A peft wrapper holds no parameters of its own: the Hugging Face model under it is the FSDP root, so
        # the rollout (which runs that model directly) and the peft forward both go through its hooks.
        apply_fsdp(base_of(module), self.config.fsdp, mesh=self.groups.mesh(role, self.device.type),
                   device_type=self.device.type)
        return module

    @contextmanager
    def gathered(self, module: torch.nn.Module) -> Iterator[None]:
        """Keep a sharded model's weights gathered for a while (generation): no collective per forward,
        so ranks whose responses finish at different steps cannot deadlock each other."""
        sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for m in sharded:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in sharded:
                m.reshard()
                m.set_reshard_after_forward(self.config.fsdp.reshard_after_forward, recurse=False)

    # ------------------------------------------------------------------ model and data
    def _resolve_dtype(self, name: str) -> torch.dtype:
        return run_dtype(name, self.device.type)

    def model_path(self) -> str:
        return resolve_model_path(self.config.model.path)

    def load_policy(self, model: torch.nn.Module | None, tokenizer: Any) -> tuple[torch.nn.Module, Any]:
        """The policy the start-up pass loaded (or was given); loads one only when asked for another."""
        pf = self.preflight
        if pf.model is not None and (model is None or model is pf.model or model is base_of(pf.model)):
            return pf.take("model"), pf.tokenizer
        if model is not None:
            return given_policy(model, tokenizer, self.device, self.config)
        model, tokenizer, report = load_policy_with_report(self.config, self.model_path(), device=self.device,
                                                           dtype=self.dtype)
        report.raise_if_problems()
        return model, tokenizer

    def load_data_rows(self, files: Sequence[str], kind: str) -> list[dict[str, Any]]:
        return read_rows(self.config, files, kind, self.tokenizer)[0]

    def split_train_val(self, kind: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(train, val) rows: those the start-up pass read, or read now (`data_split.split_train_val`)."""
        pf = self.preflight
        if pf.data is not None and kind == pf.data_kind:
            return pf.take("data").rows()
        return split_train_val(self.config, kind, self.tokenizer).rows()

    def build_env(self, rows: Sequence[Mapping[str, Any]] | None = None,
                  reward_functions: Sequence[Any] | None = None) -> Any:
        cfg = self.config
        local_reward_model = bool(cfg.reward.model_path) and "actor" in self.roles and not self.remote_reward_model
        if rows is None and reward_functions is None and not local_reward_model and self.preflight.env is not None:
            return self.preflight.take("env")  # built by the start-up pass from the same config
        train_rows = val_rows = None
        if cfg.env.name is None:
            train_rows, val_rows = (list(rows), []) if rows is not None else self.split_train_val("prompt")
        functions = list(reward_functions) if reward_functions is not None else list(cfg.reward.functions)
        if local_reward_model:
            dtype = self._resolve_dtype(cfg.reward.model_dtype or cfg.model.dtype)
            reward_model = build_reward_model_function(
                cfg.reward.model_path, dtype=dtype, device=self.device, weight=cfg.reward.model_weight,
                trust_remote_code=cfg.model.trust_remote_code)
            with_cpu_matmul(cfg, reward_model.scorer.model)
            functions.append(reward_model)
        return build_env(cfg.env, reward_functions=functions, train_rows=train_rows, val_rows=val_rows,
                         base_dir=cfg._source_dir, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)

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
        """Left-padded prompt ids and mask, through the data layer's `PromptDataset` (chat template,
        length limit). Rows are never dropped here, since each one owns n responses; `data.truncation=drop`
        already filtered over-long rows when the files were read, so a long prompt left now is an error."""
        d = self.config.data
        truncation = "truncate_left" if d.truncation == "truncate_left" else "error"
        data = PromptDataset([dict(r) for r in rows], self.tokenizer, d.max_prompt_length, truncation,
                             d.apply_chat_template)
        batch = data.collate([data[i] for i in range(len(data))])
        return batch["input_ids"], batch["attention_mask"]

    def decode_responses(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        lengths = response_mask.sum(-1).tolist()
        return [self.tokenizer.decode(ids[: int(n)].tolist(), skip_special_tokens=True)
                for ids, n in zip(response_ids, lengths, strict=True)]

    def clip_and_step(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None) -> float:
        """Clip (when configured), refuse a non-finite gradient, step; returns the pre-clip norm."""
        params = [p for p in module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2 gives a DTensor
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            raise VerlError(f"step {self.step_count + 1}: the gradient norm is {float(norm)}; the update was "
                            "skipped. Lower the learning rate, keep grad clipping on (actor.grad_clip) or use "
                            "float32 (model.dtype=float32)")
        optimizer.step()
        return float(norm)

    # ------------------------------------------------------------------ to be provided by trainers
    def step(self) -> dict[str, float]:  # pragma: no cover - abstract
        raise TypeError(f"{type(self).__name__} must implement step()")

    def validate(self) -> dict[str, float]:
        return {}

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
        and with LoRA the adapter's config (`adapter_config.json`, which names the base model)."""
        gen = getattr(self.model, "generation_config", None)
        adapter = self.model.peft_config["default"] if is_peft_model(self.model) else None
        return tuple(a for a in (self.model.config, gen, self.tokenizer, adapter) if a is not None)

    def fit(self) -> list[dict[str, float]]:
        """Train for `trainer.total_steps` (resuming first when a checkpoint exists); returns the history."""
        return loop.fit(self)

    def _log(self, tracker: Any, metrics: dict[str, float], step: int) -> None:
        loop.log_metrics(self, tracker, metrics, step)

    def write_summary(self, summary: Mapping[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(summary), indent=2), encoding="utf-8")
        return path


__all__ = ["TrainerRuntime"]
