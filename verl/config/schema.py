"""The typed schema of a training run: the single source of every default.

YAML files, `key=value` overrides, the legacy flags and the Python API all build this same object.
Every section forbids unknown keys so a typo fails loudly (with a suggestion) instead of being ignored.
"""

from __future__ import annotations

from pydantic import PrivateAttr

from verl.algorithms.estimators import ESTIMATORS
from verl.config.fsdp import FSDPConfig
from verl.config.model_data import DataConfig, EnvConfig, LoraConfig, MixtureSource, ModelConfig
from verl.config.model_roles import ActorConfig, CriticConfig, OptimConfig, RefConfig, RolloutCorrectionConfig
from verl.config.offline import DPOConfig, RMConfig, SFTConfig
from verl.config.reward_sandbox import RewardConfig, SandboxConfig
from verl.config.rollout_algorithm import AlgorithmConfig, DistillConfig, RolloutConfig, VLLMConfig
from verl.config.run_settings import CheckpointConfig, DevicesConfig, LoggingConfig, TrainerConfig
from verl.config.section import MAX_SEED, MAX_THREADS, Section

# The sections live in modules by concept; this module keeps every name importable from here.
__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "DevicesConfig",
    "DistillConfig",
    "EnvConfig",
    "FSDPConfig",
    "LoggingConfig",
    "LoraConfig",
    "MAX_SEED",
    "MAX_THREADS",
    "MixtureSource",
    "ModelConfig",
    "OptimConfig",
    "RMConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "SFTConfig",
    "SandboxConfig",
    "Section",
    "TrainerConfig",
    "VLLMConfig",
]


class RunConfig(Section):
    """The whole run. Build it with `verl.config.load_config` or `RunConfig(**dict)`."""

    _source_dir: str | None = PrivateAttr(None)  # the YAML's folder, where relative paths are also looked up

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    ref: RefConfig = RefConfig()
    reward: RewardConfig = RewardConfig()
    sandbox: SandboxConfig = SandboxConfig()
    devices: DevicesConfig = DevicesConfig()
    fsdp: FSDPConfig = FSDPConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    trainer: TrainerConfig = TrainerConfig()
    logging: LoggingConfig = LoggingConfig()
    dpo: DPOConfig = DPOConfig()
    rm: RMConfig = RMConfig()
    sft: SFTConfig = SFTConfig()

    def resolve_path(self, path: str, what: str = "data file") -> str:
        """A user's relative path by the one rule for them (`verl.utils.user_code.resolve_user_path`: the
        working directory and the YAML's folder, found in exactly one), so `data/train.jsonl` next to a
        config works from anywhere; missing or ambiguous is a DataError naming both places tried."""
        from verl.errors import DataError
        from verl.utils.user_code import resolve_user_path

        return str(resolve_user_path(path, self._source_dir, what=what,
                                     fail=lambda msg: DataError(f"{msg} (data.train_files/val_files)")))

    @property
    def needs_critic(self) -> bool:
        """Whether the advantage estimator reads a learned critic's values (from the estimator table)."""
        return ESTIMATORS[self.algorithm.adv_estimator].needs_critic

    def offloads(self, role: str) -> bool:
        """Whether FSDP2 CPU offload applies to `role`'s model: `actor.cpu_offload` / `critic.cpu_offload` where
        set, else `fsdp.cpu_offload` (the reference, teacher and reward model follow `fsdp.cpu_offload`)."""
        own = getattr(getattr(self, role, None), "cpu_offload", None) if role in ("actor", "critic") else None
        return self.fsdp.cpu_offload if own is None else own

    @property
    def needs_ref(self) -> bool:
        return self.algorithm.kl_in_reward or self.actor.kl_loss_coef > 0

    @property
    def is_async(self) -> bool:
        """Whether rollout ranks of their own generate ahead of the trainer (`devices.rollout`)."""
        return self.devices.rollout is not None and self.trainer.kind == "rl"

    @property
    def needs_teacher(self) -> bool:
        """Whether an RL run distils from a teacher (`algorithm.distill.teacher_path`)."""
        return self.algorithm.distill.teacher_path is not None
