"""What every trainer (RL, DPO, SFT) shares: device and seeds, loading the policy, the run directory,
the training loop with validation, tracking, checkpoints and exact resume.

A trainer subclass supplies `step()` (one update, returns metrics), `validate()`, and the state to save
(`app_state()` for models/optimizers, `trainer_state()` for small things, `schedulers()`).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl.config.loader import config_to_yaml
from verl.config.schema import RunConfig
from verl.errors import CheckpointError, ConfigError, DataError, DeviceMappingError, ModelError, VerlError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu "
                              "(or auto), or check CUDA_VISIBLE_DEVICES and the torch build (`verl doctor`)")
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ConfigError(f"trainer.device={name!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def resolve_run_dir(config: RunConfig, kind: str) -> Path:
    if config.trainer.run_dir:
        return Path(config.trainer.run_dir)
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_model_path(path: str) -> str:
    """`model.path`, where `tiny[:arch[:hidden[:layers]]]` is built locally (tests, the demo, offline use)."""
    if path != "tiny" and not path.startswith("tiny:"):
        return path
    from verl.models.tiny import build_tiny_model

    parts = path.split(":")[1:]
    try:
        sizes = [int(p) for p in parts[1:3]]
    except ValueError:
        raise ConfigError(f"model.path={path!r}: expected tiny[:arch[:hidden_size[:num_layers]]], e.g. "
                          "tiny:qwen2:128:2") from None
    kwargs = dict(zip(("hidden_size", "num_layers"), sizes, strict=False))
    return build_tiny_model(arch=parts[0] if parts else "qwen2", seed=0, **kwargs)


class TrainerRuntime:
    kind = "base"
    runs_split_placements = False  # roles on different ranks (RLTrainer, through its Placement)

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        from verl.distributed import RoleGroups, init_distributed
        from verl.trainer.startup import validate_startup

        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self.device = resolve_device(config.trainer.device, self.local_rank)
        if config.trainer.cpu_threads is not None:
            torch.set_num_threads(config.trainer.cpu_threads)
        # Every check that needs no weights, before anything loads (the same ones `verl check` runs).
        self.startup = validate_startup(config, world_size=self.world_size,
                                        model_path=resolve_model_path(config.model.path),
                                        device_type=self.device.type)
        self.groups = None
        mapping = self.startup.mapping
        # Roles this rank runs; a split placement (roles on different ranks) is executed by trainers that
        # support it (RLTrainer) and refused by the others before anything loads.
        self.roles: set[str] = set(mapping.roles_on(self.rank))
        self.split = self.world_size > 1 and not mapping.is_colocated()
        if self.split:
            if not self.runs_split_placements:
                raise DeviceMappingError(
                    f"this mapping places roles on different device groups; it is valid, but the {self.kind} "
                    "trainer runs every role on every rank (colocated, the default; only the RL trainer runs "
                    "split placements). Fix: remove devices.actor/critic/ref/reward (and the "
                    "--*_device_id(s) flags) to colocate.\n" + mapping.render_table())
            actor_ranks = mapping.ranks("actor")
            self.dp_rank = actor_ranks.index(self.rank) if self.rank in actor_ranks else 0
            self.dp_size = len(actor_ranks)
        if self.world_size > 1:
            env = init_distributed(config.devices.timeout_s)
            self.device = env.device if config.trainer.device != "cpu" else torch.device("cpu")
            self.groups = RoleGroups.create(self.startup.mapping, timeout_s=config.devices.timeout_s,
                                            fsdp=config.fsdp, num_gpus_per_node=config.devices.num_gpus_per_node,
                                            device=self.device)
        self.dtype = self._resolve_dtype(config.model.dtype)
        seed = config.trainer.seed
        seed_everything(seed)
        # Separate streams so that, e.g., validation sampling never shifts the training samples.
        self.generator = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.rank)
        self.shuffle_generator = torch.Generator().manual_seed(seed + 1)
        self.step_count = 0
        self.run_dir = resolve_run_dir(config, self.kind)
        self.history: list[dict[str, float]] = []

    @property
    def remote_reward_model(self) -> bool:
        """A reward model placed on ranks of its own (devices.reward apart from the actor's ranks)."""
        mapping = self.startup.mapping
        return (self.split and bool(self.config.reward.model_path) and self.config.devices.reward is not None
                and mapping.ranks("reward") != mapping.ranks("actor"))

    # ------------------------------------------------------------------ data parallelism
    def shard(self, module: torch.nn.Module, role: str) -> torch.nn.Module:
        """FSDP2-shard a trainable model over its role's ranks (a no-op in one process)."""
        from torch.distributed.fsdp import FSDPModule

        if self.groups is None or isinstance(module, FSDPModule):  # one process, or sharded already
            return module
        from verl.distributed.fsdp import apply_fsdp

        return apply_fsdp(module, self.config.fsdp, mesh=self.groups.mesh(role, self.device.type),
                          device_type=self.device.type)

    @contextmanager
    def gathered(self, module: torch.nn.Module) -> Iterator[None]:
        """Keep a sharded model's weights gathered for a while (generation): no collective per forward,
        so ranks whose responses finish at different steps cannot deadlock each other."""
        from torch.distributed.fsdp import FSDPModule

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
        from verl.utils.dtype import resolve_dtype

        if name == "auto":
            if self.device.type == "cuda" and torch.cuda.is_bf16_supported():
                return torch.bfloat16
            return torch.float32
        return resolve_dtype(name)

    def model_path(self) -> str:
        return resolve_model_path(self.config.model.path)

    def load_policy(self, model: torch.nn.Module | None, tokenizer: Any) -> tuple[torch.nn.Module, Any]:
        if model is not None:
            if tokenizer is None:
                raise ModelError("a model object was given without its tokenizer; pass tokenizer=... too "
                                 "(they must come from the same source)")
            return model.to(self.device).train(), tokenizer
        from verl.models.hf_loader import load_hf_model

        cfg = self.config.model
        path = self.model_path()
        model, tokenizer = load_hf_model(
            path, tokenizer_name=cfg.tokenizer_path, attn_implementation=cfg.attn_implementation,
            torch_dtype=self.dtype, trust_remote_code=cfg.trust_remote_code, device=self.device,
            revision=cfg.revision, for_training=True)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        return model.train(), tokenizer

    def load_data_rows(self, files: Sequence[str], kind: str) -> list[dict[str, Any]]:
        from verl.data import load_rows

        d = self.config.data
        rows, _report = load_rows([self.config.resolve_path(f) for f in files], kind, fields=d.fields or None, on_bad_row=d.on_bad_row,
                                  tokenizer=self.tokenizer, max_prompt_length=d.max_prompt_length,
                                  truncation=d.truncation, apply_chat_template=d.apply_chat_template)
        return rows

    def split_train_val(self, kind: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        d = self.config.data
        if not d.train_files:
            raise ConfigError("no training data: set data.train_files (JSONL/JSON/Parquet/CSV) or use a "
                              "built-in environment with env.name=arithmetic")
        train = self.load_data_rows(d.train_files, kind)
        if d.val_files:
            return train, self.load_data_rows(d.val_files, kind)
        if d.val_size:
            if d.val_size >= len(train):
                raise DataError(f"data.val_size={d.val_size} leaves no training rows out of {len(train)}")
            order = np.random.default_rng(self.config.trainer.seed).permutation(len(train))
            val_idx = set(order[: d.val_size].tolist())
            return ([r for i, r in enumerate(train) if i not in val_idx],
                    [r for i, r in enumerate(train) if i in val_idx])
        return train, []

    def build_env(self, rows: Sequence[Mapping[str, Any]] | None = None,
                  reward_functions: Sequence[Any] | None = None) -> Any:
        from verl.env import build_env

        cfg = self.config
        train_rows = val_rows = None
        if cfg.env.name is None:
            train_rows, val_rows = (list(rows), []) if rows is not None else self.split_train_val("prompt")
        functions = list(reward_functions) if reward_functions is not None else list(cfg.reward.functions)
        if cfg.reward.model_path and "actor" in self.roles and not self.remote_reward_model:
            from verl.trainer.reward_model import build_reward_model_function

            dtype = self._resolve_dtype(cfg.reward.model_dtype or cfg.model.dtype)
            functions.append(build_reward_model_function(
                cfg.reward.model_path, dtype=dtype, device=self.device, weight=cfg.reward.model_weight,
                trust_remote_code=cfg.model.trust_remote_code))
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
        from verl.data import PromptDataset

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

    # ------------------------------------------------------------------ checkpoint state
    def _extra_state(self) -> dict[str, Any]:
        from verl.checkpoint import capture_rng_state

        return {
            "step": self.step_count,
            "trainer": self.trainer_state(),
            "schedulers": {k: s.state_dict() for k, s in self.schedulers().items()},
            "generators": {"sample": self.generator.get_state(), "shuffle": self.shuffle_generator.get_state()},
            "rng": capture_rng_state(),
            "history": self.history,
            "config_yaml": config_to_yaml(self.config),
        }

    def _restore_extra(self, extra: Mapping[str, Any]) -> None:
        from verl.checkpoint import restore_rng_state

        self.step_count = int(extra["step"])
        self.load_trainer_state(extra["trainer"])
        for name, sched in self.schedulers().items():
            if name not in extra["schedulers"]:
                raise CheckpointError(
                    f"rank {self.rank}: the checkpoint holds no {name!r} for this rank (it has "
                    f"{sorted(extra['schedulers'])}); it was saved with another role placement (devices.actor/"
                    "critic/ref). Fix: resume with the devices.* placement it was saved with, or set "
                    "trainer.resume=never")
            sched.load_state_dict(extra["schedulers"][name])
        self.generator.set_state(extra["generators"]["sample"])
        self.shuffle_generator.set_state(extra["generators"]["shuffle"])
        restore_rng_state(extra["rng"])
        self.history = list(extra.get("history", []))

    def hf_assets(self) -> tuple[Any, ...]:
        """What `verl ckpt export` needs to rebuild a Hugging Face folder: config, generation config, tokenizer."""
        gen = getattr(self.model, "generation_config", None)
        return tuple(a for a in (self.model.config, gen, self.tokenizer) if a is not None)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, float]]:
        """Train for `trainer.total_steps` (resuming first when a checkpoint exists); returns the history."""
        from verl.checkpoint import CheckpointManager, GracefulStop
        from verl.tracking import Tracker

        cfg = self.config
        ckpt = CheckpointManager(self.run_dir, save_interval=cfg.checkpoint.save_interval,
                                 save_total_limit=cfg.checkpoint.save_total_limit,
                                 async_save=cfg.checkpoint.async_save, rank=self.rank, world_size=self.world_size)
        resume_from = ckpt.find_resume(cfg.trainer.resume)
        if resume_from is not None:
            self._restore_extra(ckpt.load(resume_from, app_state=self.app_state()))
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
        tracker = Tracker(cfg.logging.backends, self.run_dir, config=cfg.model_dump(mode="json"),
                          total_steps=cfg.trainer.total_steps, project=cfg.logging.project,
                          experiment=cfg.logging.experiment, enabled=self.rank == 0, resume_step=self.step_count)
        if resume_from is not None and self.rank == 0:
            tracker.truncate_after(self.step_count)
        try:
            with GracefulStop() as stop:
                if self.step_count == 0 and cfg.trainer.val_before_train:
                    self._log(tracker, self.validate(), 0)
                while self.step_count < cfg.trainer.total_steps:
                    metrics = self.step()
                    self.step_count += 1
                    last = self.step_count == cfg.trainer.total_steps
                    every = cfg.trainer.val_every
                    if last or (every and self.step_count % every == 0):
                        metrics |= self.validate()
                    self._log(tracker, metrics, self.step_count)
                    if ckpt.should_save(self.step_count, last) or stop.requested:
                        ckpt.save(self.step_count, app_state=self.app_state(), extra=self._extra_state(),
                                  hf_assets=self.hf_assets())
                    if stop.requested:
                        break
            ckpt.wait()
        finally:
            ckpt.close()
            tracker.close()
        return self.history

    def _log(self, tracker: Any, metrics: dict[str, float], step: int) -> None:
        if not metrics:
            return
        self.history.append({"step": step, **metrics})
        if step % self.config.trainer.log_every == 0 or step == self.config.trainer.total_steps or step == 0:
            tracker.log(metrics, step)

    def write_summary(self, summary: Mapping[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(summary), indent=2), encoding="utf-8")
        return path
