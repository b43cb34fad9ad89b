"""Can the configured rollout engine run here? Checked before anything loads (by ``verl check`` and the
trainer's start-up pass), so a vLLM run on a machine that cannot serve it fails in seconds with the fix,
not after the policy has loaded. vLLM is looked up, never imported."""

from __future__ import annotations

import importlib.util

from verl.errors import ConfigError


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # already imported without a spec (e.g. a stand-in module): it is there
        return True


def check_rollout_engine(engine: str, *, device_type: str) -> list[ConfigError]:
    """Problems with running rollout engine `engine` on `device_type` ("cpu" or "cuda")."""
    if engine != "vllm":
        return []
    problems = []
    if device_type != "cuda":
        problems.append(ConfigError(
            f"rollout.engine=vllm needs a CUDA GPU, but this run is on {device_type!r} (trainer.device, or no "
            "CUDA device visible here). Fix: run on a GPU node with trainer.device=cuda, or set "
            "rollout.engine=hf (our own sampler, runs on CPU and GPU)."))
    if not _installed("vllm"):
        problems.append(ConfigError(
            "rollout.engine=vllm but the vllm package is not installed in this Python environment. Fix: "
            "pip install vllm (on the GPU node), or set rollout.engine=hf."))
    return problems


def check_vllm_placement(engine: str, actor_ranks: tuple[int, ...], world_size: int,
                         rollout_ranks: tuple[int, ...] = ()) -> list[ConfigError]:
    """vLLM under torchrun (``external_launcher``) builds its process groups over every rank of the run, so
    every rank must build an engine: the actor's ranks (which own one, for their rollouts or validation) and
    an asynchronous run's rollout ranks (``devices.rollout``) together must be all of them."""
    building = set(actor_ranks) | set(rollout_ranks)
    if engine != "vllm" or world_size <= 1 or building == set(range(world_size)):
        return []
    others = sorted(set(range(world_size)) - building)
    where = f"the actor on ranks {list(actor_ranks)}" + (f" and rollout ranks {list(rollout_ranks)}"
                                                         if rollout_ranks else "")
    return [ConfigError(
        f"rollout.engine=vllm with {where} of {world_size}: vLLM's external_launcher executor creates its "
        f"process groups over all ranks of the run, so rank(s) {others}, which build no engine, would leave it "
        "waiting forever. Fix: place the actor on every rank (the default colocated placement, devices.*), or "
        "on every rank that devices.rollout does not take (asynchronous RL), or use rollout.engine=hf with this "
        "split placement.")]


__all__ = ["check_rollout_engine", "check_vllm_placement"]
