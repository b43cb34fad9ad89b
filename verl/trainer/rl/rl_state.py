"""What an RL trainer's checkpoint holds beyond the weights: the controllers' and the environment's state,
and which models, optimizers and schedulers each rank of a split placement saves (their union is the
checkpoint). A mixin of `RLTrainer`, kept apart so the trainer's file holds the step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RLCheckpointState:
    """Reads the RL trainer's attributes (kl_ctrl, env, drift_guard, entropy_ctrl, the models, optimizers and
    schedulers, roles) set in `RLTrainer.__init__`."""

    def _stateful(self) -> dict[str, Any]:
        parts = {"kl_ctrl": self.kl_ctrl, "env": self.env, "drift_guard": self.drift_guard}
        return parts if self.entropy_ctrl is None else {**parts, "entropy_ctrl": self.entropy_ctrl}

    def trainer_state(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self._stateful().items()}

    def load_trainer_state(self, state: Mapping[str, Any]) -> None:
        for name, part in self._stateful().items():
            if name in state:  # a checkpoint from before the drift guard, or of a run without the controller
                part.load_state_dict(state[name])

    def app_state(self) -> dict[str, Any]:
        """What this rank holds (split placements: actor ranks the policy, critic ranks the critic; the
        checkpoint is their union)."""
        actor = {"model": self.model, "optimizer": self.optimizer}
        critic = {"critic": self.critic, "critic_optimizer": self.critic_optimizer}
        return (actor if "actor" in self.roles else {}) | (critic if self.critic is not None else {})

    def schedulers(self) -> dict[str, Any]:
        return (({"scheduler": self.scheduler} if "actor" in self.roles else {})
                | ({"critic_scheduler": self.critic_scheduler} if self.critic is not None else {}))

    def hf_assets(self) -> tuple[Any, ...]:
        return self._hf_assets  # captured at start-up: a critic-only rank (maybe rank 0) holds no policy


__all__ = ["RLCheckpointState"]
