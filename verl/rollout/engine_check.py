"""Can the configured rollout engine run here? Checked before anything loads (by ``verl check`` and the
trainer's start-up pass), so a vLLM run on a machine that cannot serve it fails in seconds with the fix,
not after the policy has loaded. vLLM is looked up, never imported."""

from __future__ import annotations

import importlib.util

from verl.errors import ConfigError

# The share of the GPU an asynchronous rollout rank's vLLM takes when rollout.vllm.rollout_rank_gpu_memory_utilization
# is None: nothing else lives on that GPU (the rank's copy of the policy moves to the CPU first); a little below
# vLLM's own default (0.92), for the CUDA context and NCCL buffers of the run's process group.
ROLLOUT_RANK_GPU_MEMORY_UTILIZATION = 0.9


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


def describe_vllm_memory(engine: str, gpu_memory_utilization: float, rollout_rank_utilization: float | None,
                         rollout_ranks: tuple[int, ...]) -> str | None:
    """What memory an asynchronous run's vLLM engines get (`verl check`), or None when no rank is a rollout
    rank. vLLM's ``ExecutorWithExternalLauncher.determine_available_memory`` (vllm/v1/executor/uniproc_executor.py)
    all-reduces the KV-cache memory each engine has left with MIN over the whole torch.distributed world, so every
    rank's KV cache is the smallest one: the actor ranks', whose engines take a smaller share next to the trainer's
    resident state, bounds the rollout ranks' however much of their own GPU those may take. The rollout ranks
    cannot have a vLLM world of their own: external_launcher builds its groups over every rank (see
    `check_vllm_placement`)."""
    if engine != "vllm" or not rollout_ranks:
        return None
    rollout = ROLLOUT_RANK_GPU_MEMORY_UTILIZATION if rollout_rank_utilization is None else rollout_rank_utilization
    share = min(gpu_memory_utilization, rollout)
    default = " (the default)" if rollout_rank_utilization is None else ""
    capped = ("; the rollout ranks' larger share does not enlarge it" if rollout > gpu_memory_utilization else
              "; the rollout ranks' smaller share shrinks the actor ranks' too" if rollout < gpu_memory_utilization
              else "")
    return ("vLLM memory: the actor ranks' engines take "
            f"rollout.vllm.gpu_memory_utilization={gpu_memory_utilization:g} "
            f"of their GPU, the rollout ranks' {list(rollout_ranks)} rollout_rank_gpu_memory_utilization={rollout:g}"
            f"{default}. Under torchrun vLLM gives every rank the smallest KV cache of all ranks (a MIN all-reduce "
            f"in its external_launcher executor), so each rank's KV-cache budget is {share:g} x GPU memory - vLLM's "
            f"weights - its activation peak{capped}. A larger KV cache on the rollout ranks needs a larger "
            "rollout.vllm.gpu_memory_utilization, which the actor ranks must also fit beside the trainer's state "
            "(see the memory plan).")


__all__ = ["ROLLOUT_RANK_GPU_MEMORY_UTILIZATION", "check_rollout_engine", "check_vllm_placement",
           "describe_vllm_memory"]
