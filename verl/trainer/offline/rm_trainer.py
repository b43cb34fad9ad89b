"""`RMTrainer` (`trainer.kind: rm`): a Bradley–Terry reward model on preference pairs, as TRL's RewardTrainer.

The model is the policy's causal LM with its LM head replaced by a one-label score head (a Hugging Face
`*ForSequenceClassification`, see `verl.models.reward_model`), read at each sequence's last real token. It
reads each answer exactly as RL scores it with `reward.model_path` (`verl.data.chat.reward_text`), and its
final checkpoint is written as an `AutoModelForSequenceClassification` folder (`<run_dir>/reward_model`) that
`reward.model_path`, TRL and OpenRLHF load. The loss is `verl.algorithms.bradley_terry_loss`; the step and the
held-out evaluation are the preference trainers' (`PairTrainer`).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from verl.algorithms import bradley_terry_loss
from verl.checkpoint import export_hf
from verl.checkpoint.manager import CHECKPOINTS_DIR, read_latest
from verl.config.schema import RunConfig
from verl.data.datasets import RewardPairDataset, left_pad, pad_token_id
from verl.errors import CheckpointError
from verl.models.reward_model import sequence_scores
from verl.trainer.checks.preflight import Given
from verl.trainer.compose.components import compose_offline
from verl.trainer.forward.pair_rows import pair_scores
from verl.trainer.offline.base import PairTrainer, Rows
from verl.utils.tokenizer_protocol import Tokenizer

EXPORT_DIR = "reward_model"


class RMTrainer(PairTrainer):
    """Reward-model training. `RMTrainer(config).fit()`, or from Python with a loaded model:
    `RMTrainer(config, model=m, tokenizer=t, train_rows=[{"prompt", "chosen", "rejected"[, "margin"]}, ...])`.
    A causal LM passed in gets a score head on its own backbone (so training changes it: pass a copy to keep
    it); a one-label sequence classifier trains as it is.

    `actor.micro_batch_size` counts sequences per forward, so a micro-batch holds half as many pairs.
    Learning rate `rm.lr`; schedule, warm-up, weight decay and grad clipping from `actor`.
    """

    kind = "rm"

    def __init__(
        self,
        config: RunConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        train_rows: Rows | None = None,
        val_rows: Rows | None = None,
    ) -> None:
        super().__init__(config, given=Given(model=model, tokenizer=tokenizer, rows=train_rows, val_rows=val_rows))
        d = config.data
        self.pad_id = pad_token_id(self.tokenizer)
        train, val = self.train_val_rows(train_rows, val_rows)
        self.train_data = self._dataset(train)
        self.val_data = self._dataset(val) if val else None
        self.sampler = self.build_sampler(len(self.train_data), d.train_batch_size, "data.train_batch_size")
        self.pairs_per_micro = max(1, config.actor.micro_batch_size // 2)
        optim = compose_offline(self.parts, config, lr=config.rm.lr, total_steps=config.trainer.total_steps)
        self.model, (self.optimizer, self.scheduler) = self.parts.policy, optim.pair()
        self.export_dir: Path | None = None  # set by `fit` once written

    def _dataset(self, rows: list[dict[str, Any]]) -> RewardPairDataset:
        d = self.config.data
        return RewardPairDataset(rows, self.tokenizer, self.max_length, d.truncation, d.apply_chat_template)

    # ------------------------------------------------------------------ scores and the loss
    def pair_scores(self, data: RewardPairDataset, indices: Sequence[int]) -> torch.Tensor:
        """Rewards [m, 2] (chosen, rejected) of the pairs `indices`, differentiable, from one forward: each pair in
        one row, their shared tokens once (`verl.trainer.forward.pair_rows`), where the model takes that and
        `actor.share_prompt_forward` is on; else the chosen then the rejected sequences, left-padded (the score
        position does not depend on the padding side)."""
        items = [data[i] for i in indices]
        chosen, rejected = [it["chosen_input_ids"] for it in items], [it["rejected_input_ids"] for it in items]
        if self.config.actor.share_prompt_forward and self.sp is None:
            scores = pair_scores(self.model, chosen, rejected, self.pad_id, self.device)
            if scores is not None:
                return scores.float()
        ids, mask = left_pad(chosen + rejected, self.pad_id)
        scores = sequence_scores(self.model, ids.to(self.device), mask.to(self.device)).float()
        return torch.stack(scores.chunk(2), dim=1)

    def pair_loss(self, split: str, data: RewardPairDataset,
                  indices: Sequence[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair losses [m] and statistics (rewards, their margin, whether chosen wins) for `indices`."""
        rewards = self.pair_scores(data, indices)
        margins = [data[i]["margin"] for i in indices]
        margin = torch.tensor(margins, dtype=torch.float32, device=self.device) if any(margins) else None
        losses = bradley_terry_loss(rewards[:, 0], rewards[:, 1], margin, self.config.rm.center_rewards_coefficient)
        chosen, rejected = rewards[:, 0].detach(), rewards[:, 1].detach()
        return losses, {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                        "accuracy": (chosen > rejected).float()}

    def evaluate(self, rows: Rows) -> dict[str, float]:
        """Loss, accuracy (chosen preferred) and reward margins of the model as it is now on pairs that neither
        train nor validate it (`{"prompt", "chosen", "rejected"}` rows, e.g. a test set)."""
        return self.evaluate_pairs("eval", self._dataset(list(self.normalize_rows(rows, "rows", "test"))))

    # ------------------------------------------------------------------ the exported model
    def fit(self) -> list[dict[str, float]]:
        """Train (see `TrainerRuntime.fit`), then write `<run_dir>/reward_model` from the final checkpoint
        (`rm.export`)."""
        history = super().fit()
        if self.config.rm.export and not self.config.trainer.val_only:
            self.export_dir = self.export()
        return history

    def export(self, out: str | Path | None = None) -> Path:
        """The newest checkpoint of this run as a Hugging Face `AutoModelForSequenceClassification` folder
        (default `<run_dir>/reward_model`, replaced if it holds an earlier export): rank 0 writes it through
        `verl.checkpoint.export_hf` (LoRA merged, FSDP shards gathered), the other ranks wait for it."""
        root = self.run_dir / CHECKPOINTS_DIR
        name = read_latest(root)
        if name is None:
            raise CheckpointError(f"{root}: no checkpoint to export the reward model from; run fit() first")
        target = Path(out) if out is not None else self.run_dir / EXPORT_DIR
        if self.rank == 0:
            if target.exists() and (target / "config.json").is_file() and out is None:
                shutil.rmtree(target)  # our own earlier export (a resumed run, a second fit)
            export_hf(root / name, target)  # the checkpoint's hf/ holds the classifier's config and the tokenizer
        dist = torch.distributed
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank goes on before the folder exists
        return target


__all__ = ["EXPORT_DIR", "RMTrainer"]
