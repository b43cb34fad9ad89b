"""Start-up checks of the sizes a run cannot survive that need the model's config (no weights): its tokens
within the model's positions, and on CPU a host-memory plan that refuses a step that cannot fit in RAM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl.config.schema import RunConfig
from verl.errors import ConfigError, VerlError
from verl.trainer.checks.policy_facts import PolicyFacts

GiB = 1024**3


def text_config(config: RunConfig, model_path: str | None) -> Any:
    """The model's (text) config read off its folder, or None where there is no local config.json to read."""
    return PolicyFacts(config, model_path).text_config


def lengths(config: RunConfig, kind: str) -> tuple[str, int, str, int]:
    """(prompt key, its tokens, response key, its tokens) of a sequence of this run."""
    d = config.data
    if kind == "rl":
        return "data.max_prompt_length", d.max_prompt_length, "rollout.max_new_tokens", config.rollout.max_new_tokens
    return "data.max_prompt_length", d.max_prompt_length, "data.max_response_length", d.max_response_length


def check_positions(config: RunConfig, kind: str, model_path: str | None, cfg: Any = None) -> list[VerlError]:
    """A prompt and its response must fit the model's positions (`max_position_embeddings`): the sampler and
    the forward refuse a longer sequence, but only once the weights are loaded and a step has started."""
    if kind != "rl":  # SFT/DPO rows are as long as the data is; an RL response is sampled to its limit
        return []
    cfg = cfg if cfg is not None else text_config(config, model_path)
    limit = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return []
    pkey, prompt, rkey, response = lengths(config, kind)
    if prompt + response <= limit:
        return []
    room = limit - prompt
    fix = (f"set {rkey} to at most {room}" if room > 0 else f"lower {pkey} below {limit}") + f" (or {pkey})"
    return [ConfigError(f"{pkey}={prompt} + {rkey}={response} = {prompt + response} tokens, past the "
                        f"{limit} positions of the model ({model_path}: max_position_embeddings); the sampler "
                        f"would refuse it at the first step. Fix: {fix}")]


def available_bytes() -> int | None:
    """The host's available memory (MemAvailable: free plus reclaimable), None where it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_plan(config: RunConfig, cfg: Any, processes: int = 1, *, on_gpu: bool = False,
              nodes: int = 1) -> tuple[int, list[tuple[str, int]]]:
    """A lower estimate of an RL step's host memory on CPU (float32), per part: the models and the actor's
    optimizer, the step's sequences (ids, masks, log-probs, advantages) and the generation's KV cache over
    all of them, and one training micro-batch's logits and activations. Bytes, times `processes` (each CPU
    process holds its own). `on_gpu`: only the sequences, which the host holds too (for the reward, the
    samples, the batch between phases), split over `nodes`."""
    hidden, layers, vocab = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    kv_dim = int(getattr(cfg, "num_key_value_heads", None) or heads) * int(
        getattr(cfg, "head_dim", None) or hidden // heads)
    params = 12 * layers * hidden * hidden + vocab * hidden  # a decoder's layers and one embedding
    _, prompt, _, response = lengths(config, "rl")
    tokens = prompt + response
    sequences = config.data.train_batch_size * config.rollout.n
    copies = 4 + (1 if config.needs_ref else 0) + (4 if config.needs_critic else 0)
    micro = config.actor.micro_batch_size
    if on_gpu:
        per_node = -(-sequences // max(1, nodes))
        return per_node * tokens * 32, [(f"the step's {sequences:,} sequences x {tokens} tokens",
                                         per_node * tokens * 32)]
    parts = [("weights and optimizer (float32)", params * 4 * copies),
             (f"the step's {sequences:,} sequences x {tokens} tokens", sequences * tokens * 32),
             ("the generation's KV cache", sequences * tokens * layers * 2 * kv_dim * 4),
             (f"a micro-batch of {micro} (logits and activations)",
              micro * tokens * (vocab * 4 * 2 + hidden * layers * 4 * 8))]
    return sum(n for _, n in parts) * processes, parts


def check_host_memory(config: RunConfig, kind: str, model_path: str | None, *, processes: int = 1,
                      cfg: Any = None, available: int | None = None, on_gpu: bool = False,
                      nodes: int = 1) -> list[VerlError]:
    """Refuse an RL step whose lower estimate (`host_plan`: all of it on a CPU run, the sequences `on_gpu`) is
    past the host's available memory, with the numbers and the settings to change."""
    if kind != "rl":
        return []
    cfg = cfg if cfg is not None else text_config(config, model_path)
    if cfg is None or not all(hasattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")):
        return []
    available = available if available is not None else available_bytes()
    if available is None:
        return []
    need, parts = host_plan(config, cfg, processes, on_gpu=on_gpu, nodes=nodes)
    if need <= available:
        return []
    shown = "; ".join(f"{name} {n / GiB:,.1f} GiB" for name, n in parts)
    per = f" x {processes} processes" if processes > 1 and not on_gpu else ""
    step = "an RL step's sequences on a GPU run (the host holds them too)" if on_gpu else "an RL step on CPU"
    return [ConfigError(f"host memory: {step} needs at least {need / GiB:,.1f} GiB ({shown}{per}), and "
                        f"this host has {available / GiB:,.1f} GiB available. Fix: lower rollout.n={config.rollout.n} "
                        f"or data.train_batch_size={config.data.train_batch_size} (sequences per step), "
                        f"rollout.max_new_tokens={config.rollout.max_new_tokens} or actor.micro_batch_size="
                        f"{config.actor.micro_batch_size}")]
