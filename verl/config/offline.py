"""The sections of the offline trainers: DPO, reward models (trainer.kind: rm) and SFT."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from verl.config.section import Section


class DPOConfig(Section):
    beta: float = Field(0.1, gt=0.0)
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    precompute_ref: bool = False
    lr: float = Field(5e-7, gt=0.0)


class RMConfig(Section):
    """`trainer.kind: rm`: a Bradley–Terry reward model on preference pairs (data.kind: preference)."""

    lr: float = Field(1e-5, gt=0.0, description="Learning rate of the reward model (backbone and score head); "
                      "schedule, warm-up, weight decay and grad clipping come from actor.*.")
    center_rewards_coefficient: float = Field(
        0.0, ge=0.0, description="Adds c x mean((r_chosen + r_rejected)^2) to the loss (TRL's "
        "center_rewards_coefficient, e.g. 0.01): keeps the rewards centred on 0, which the pairwise loss alone "
        "leaves free. 0 = off.")
    export: bool = Field(True, description="At the end of training write <run_dir>/reward_model: a Hugging Face "
                         "AutoModelForSequenceClassification folder (num_labels=1, LoRA merged) that "
                         "reward.model_path, TRL and OpenRLHF load.")


class SFTConfig(Section):
    packing: bool = False
    lr: float = Field(1e-5, gt=0.0)
    epochs: int | None = Field(None, gt=0)
    steps: int | None = Field(None, gt=0, description="Optimizer steps of the demo's warm start / a fixed budget.")
    batch_size: int = Field(32, gt=0)
