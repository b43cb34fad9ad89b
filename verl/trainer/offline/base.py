"""`OfflineTrainer`: what the dataset trainers (SFT, DPO, reward model) share on top of the runtime.

Rows from files or Python (through the same field aliases and checks), a resumable sampler that picks
each step's rows, data-parallel batch sharding, the optimizer state in checkpoints and `train_steps(n)`.
`PairTrainer` adds what the preference trainers (DPO, reward model) share: the step and the held-out
evaluation over pairs, around their own `pair_loss`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.data.fields import RowError, RowNormalizer
from verl.data.hf import is_hf
from verl.data.sampler import ResumableOrder
from verl.data.split import python_rows, split_train_val
from verl.distributed.offload import activations_offloaded
from verl.distributed.sequence_parallel import SequenceParallel, enable_sequence_parallel
from verl.errors import ConfigError, DataError
from verl.models.lora import base_of
from verl.trainer.checks.preflight import Given
from verl.trainer.compose.components import Components
from verl.trainer.compose.runtime import TrainerRuntime
from verl.trainer.forward.logprobs import use_chunked_logprobs

Rows = Sequence[Mapping[str, Any]]


class OfflineTrainer(TrainerRuntime):
    """What the dataset trainers share: rows (from files or Python), a resumable sampler, the optimizer
    state in checkpoints, data-parallel batch sharding, sequence parallelism and `train_steps(n)`."""

    data_kind = "sft"
    train_data: Any = None  # the datasets the subclass builds (SFT: None for pre-tokenised examples)
    val_data: Any = None

    def __init__(self, config: RunConfig, *, given: Given = Given(), parts: Components | None = None) -> None:
        super().__init__(config, given=given, parts=parts)
        self.sp = self.split_sequences() if parts is None else None  # a warm start on parts runs whole sequences

    # ------------------------------------------------------------------ sequence parallelism
    def split_sequences(self) -> SequenceParallel | None:
        """This rank's sequence-parallel group (`actor.sequence_parallel_size`), with the policy's attention
        made to split sequences (before any reference copy, which then splits too). The S ranks of a group
        read the same rows and each computes the part of their gradient through its tokens: data parallelism
        is over the groups (`dp_size` of them), FSDP's average over all ranks (`sp_size` per group)."""
        size = self.config.actor.sequence_parallel_size
        sp = self.groups.sequence_parallel() if size > 1 and self.groups is not None else None
        if sp is None:
            return None
        enable_sequence_parallel(base_of(self.model), size)
        self.dp_rank, self.dp_size = self.dp_rank // size, self.dp_size // size  # groups are consecutive ranks
        return sp

    @property
    def sp_size(self) -> int:
        return self.sp.size if self.sp is not None else 1

    # ------------------------------------------------------------------ rows
    def normalize_rows(self, rows: Rows | Any, name: str, purpose: str = "train") -> Sequence[dict[str, Any]]:
        """Rows from Python through the same field aliases and checks as rows read from files: a list of
        dicts, or a `datasets.Dataset` / `DatasetDict` (the split named for `purpose`), which is checked with
        the files' report and read on demand."""
        if is_hf(rows):
            return python_rows(rows, self.config, self.data_kind, name, purpose)
        norm = RowNormalizer(self.data_kind, self.config.data.fields or None)
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise DataError(f"{name}[{i}] is a {type(row).__name__}; each row must be a dict, e.g. "
                                f"{self._row_example()}")
            try:
                canonical, _ = norm.normalize(dict(row))
            except RowError as e:
                field = f" (field {e.field!r})" if e.field else ""
                raise DataError(f"{name}[{i}]: {e.detail}{field}; rows of kind {self.data_kind!r} look like "
                                f"{self._row_example()}") from None
            canonical["file"], canonical["line"] = name, i
            out.append(canonical)
        return out

    def _row_example(self) -> str:
        if self.data_kind == "preference":
            return '{"prompt": "...", "chosen": "...", "rejected": "..."}'
        return '{"input": "...", "output": "..."} or {"messages": [...]}'

    def train_val_rows(self, train_rows: Rows | None, val_rows: Rows | None) -> tuple[Sequence[dict], Sequence[dict]]:
        """Rows given in Python take precedence over data.train_files / data.val_files; either way the
        validation rows come from `data_split.split_train_val` (val files, else `data.val_size` held out)."""
        if train_rows is None:
            train, val = self.checks.data.rows()  # read and checked by the check pass
        else:
            train = self.normalize_rows(train_rows, "train_rows")
            if not train:
                raise DataError(f"train_rows is empty; pass at least one row like {self._row_example()}")
            if val_rows is None:
                train, val = split_train_val(self.config, self.data_kind, self.tokenizer, train=train).rows()
        if val_rows is not None:
            val = self.normalize_rows(val_rows, "val_rows", "val")
        return train, val

    @property
    def max_length(self) -> int:
        d = self.config.data
        return d.max_prompt_length + d.max_response_length

    def chunks_logprobs(self, model: torch.nn.Module) -> bool:
        """`actor.chunked_logprobs` for `model`'s passes here: micro-batches of `actor.micro_batch_size`
        sequences of up to `max_length` tokens (the policy and a reference decide alike)."""
        return use_chunked_logprobs(self.config, model, self.config.actor.micro_batch_size * self.max_length)

    @property
    def chunked_logprobs(self) -> bool:
        return self.chunks_logprobs(self.model)

    def warn_boundary_mismatch(self, count: int, total: int, split: str) -> None:
        """Rows whose tokenised prompt is not a prefix of prompt+response train on a recomputed boundary."""
        self.boundary_mismatch[split] = count
        if count:
            warnings.warn(
                f"{count} of {total} {split} rows: the tokenised prompt is not a prefix of the tokenised "
                "prompt+response (a token merges across the boundary, e.g. a prompt ending in a space, or "
                "a chat template that is not prefix-stable); their loss boundary was recomputed from "
                "character offsets. End prompts without trailing whitespace to avoid this",
                stacklevel=3)

    # ------------------------------------------------------------------ batches
    def build_sampler(self, num_rows: int, batch_size: int, key: str) -> ResumableOrder:
        """A row stream: a fresh seeded permutation every epoch, read `batch_size` rows at a time.

        Batches run across epoch ends, so no row is dropped and a batch may be larger than the dataset
        (a small warm-start set with a large batch still sees every row equally often).
        """
        if batch_size % self.dp_size:
            ranks = (f"{self.dp_size} data-parallel replicas (sequence-parallel groups of {self.sp_size} ranks)"
                     if self.sp_size > 1 else f"{self.dp_size} data-parallel ranks")
            raise ConfigError(f"{key}={batch_size} is not divisible by the {ranks}; use a multiple of {self.dp_size}")
        self.batch_size = batch_size
        return ResumableOrder(num_rows, seed=self.config.trainer.seed, shuffle=self.config.data.shuffle)

    def steps_for_epochs(self, epochs: int) -> int:
        """Optimizer steps that read `epochs` passes over the training rows (the last step may run over)."""
        return max(1, -(-epochs * self.sampler.num_rows // self.batch_size))

    def next_indices(self) -> list[int]:
        """This rank's share of the next batch (contiguous slices, as RLTrainer shards prompts)."""
        idx = self.sampler.take(self.batch_size)
        per_rank = len(idx) // self.dp_size
        return idx[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def global_sum(self, values: Sequence[float]) -> tuple[list[float], bool]:
        """Sum over data-parallel replicas (when a process group is up); returns (sums, whether reduced). On a
        split placement (a warm start on an RL trainer's parts, `on_parts`) those are the actor's ranks. The
        ranks of a sequence-parallel group hold the same values, which the sum over all ranks counts S times."""
        dist = torch.distributed
        if self.dp_size > 1 and dist.is_available() and dist.is_initialized():
            t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
            if self.split:
                self.groups.all_reduce(t, "actor", "offline:sum")
            else:
                dist.all_reduce(t)
            return (t / self.sp_size).tolist(), True
        return list(values), False

    def row_counts(self) -> tuple[int, int] | None:
        data, val = self.train_data, self.val_data
        return None if data is None else (len(data), len(val) if val is not None else 0)

    # ------------------------------------------------------------------ runs and state
    def train_steps(self, n: int) -> list[dict[str, float]]:
        """Run `n` optimizer steps now and return their metrics: no checkpoint, resume, validation or logs.

        `fit()` runs the same `step()`; this is for callers that only want the trained model (a warm start).
        """
        if n < 0:
            raise ConfigError(f"train_steps(n={n}): n must be >= 0")
        out = []
        for _ in range(n):
            out.append(self.step())
            self.step_count += 1
        return out

    def app_state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def trainer_state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_trainer_state(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(dict(state["sampler"]))

    def schedulers(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler}


class PairTrainer(OfflineTrainer):
    """A preference trainer: each step takes `data.train_batch_size` pairs in micro-batches of
    `pairs_per_micro`, and `pair_loss` gives per-pair losses and statistics (chosen first: [m] tensors)."""

    data_kind = "preference"
    pairs_per_micro = 1
    EVAL_KEYS = ("loss", "accuracy", "rewards/margins", "rewards/chosen", "rewards/rejected")

    def pair_loss(self, split: str, data: Any, indices: Sequence[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise TypeError(f"{type(self).__name__} must implement pair_loss()")  # pragma: no cover - abstract

    def step(self) -> dict[str, float]:
        """One optimizer step on the next `data.train_batch_size` pairs."""
        start = time.perf_counter()
        indices = self.next_indices()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Each pair weighs 1 / (pairs on this rank); every replica holds as many pairs and gradients are
        # averaged over ranks (S per sequence-parallel group, each with a part), so this is the mean over
        # the global batch.
        weight = self.sp_size / len(indices)
        sums: dict[str, float] = {}
        for s in range(0, len(indices), self.pairs_per_micro):
            chunk = indices[s : s + self.pairs_per_micro]
            with activations_offloaded(self.config.actor.activation_offload, self.device):
                losses, stats = self.pair_loss("train", self.train_data, chunk)
            (losses.sum() * weight).backward()
            for k, v in {"loss": losses.detach(), **stats}.items():
                sums[k] = sums.get(k, 0.0) + float(v.double().sum())
        grad_norm = self.clip_and_step(self.model, self.optimizer, self.config.actor.grad_clip, self.scheduler)
        seconds = time.perf_counter() - start
        tokens = sum(len(self.train_data[i][f"{side}_input_ids"]) for i in indices for side in ("chosen", "rejected"))
        # Logged as means over the global batch, like the gradient (not this rank's share).
        names = list(sums)
        totals, _ = self.global_sum([*(sums[k] for k in names), len(indices)])
        metrics = {k: v / max(totals[-1], 1) for k, v in zip(names, totals[:-1], strict=True)}
        metrics |= {"grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0], "timing/step": seconds,
                    "perf/tokens_per_s": tokens * self.dp_size / max(seconds, 1e-9)}
        return metrics

    def validate(self) -> dict[str, float]:
        """Loss, accuracy (chosen preferred) and reward margins on the held-out pairs (summed over ranks)."""
        if self.val_data is None:
            return {}
        return {f"val/{k}": v for k, v in self.evaluate_pairs("val", self.val_data).items()}

    def evaluate_pairs(self, split: str, data: Any) -> dict[str, float]:
        indices = list(range(self.dp_rank, len(data), self.dp_size))
        keys = self.EVAL_KEYS
        sums = [0.0] * len(keys)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for s in range(0, len(indices), self.pairs_per_micro * 2):
                losses, stats = self.pair_loss(split, data, indices[s : s + self.pairs_per_micro * 2])
                stats["loss"] = losses
                for j, k in enumerate(keys):
                    sums[j] += float(stats[k].double().sum())
        self.model.train(was_training)
        totals, _ = self.global_sum([*sums, len(indices)])
        count = max(totals[-1], 1)
        return {k: v / count for k, v in zip(keys, totals[:-1], strict=True)}


__all__ = ["OfflineTrainer", "PairTrainer", "Rows"]
