"""A bridge to vLLM for GPU rollouts, kept in sync with the policy.

vLLM is optional (``pip install vllm``, needs a CUDA GPU): importing verl never imports it, and asking for
this engine without it installed is a ConfigError that says how to install it (``verl check`` refuses
``rollout.engine=vllm`` without vllm or without CUDA before anything loads).

vLLM loads its own copy of the weights from ``model_path``. The trainer pushes the policy's weights into
it before every rollout (:func:`verl.rollout.weight_sync.synced`: gathered from FSDP shards, LoRA merged)
through vLLM's in-process weight loader (``model.load_weights``), and, colocated with the trainer, puts
it to sleep (``LLM.sleep(level=2)``: KV cache and weights discarded, since the next push replaces them) while
the trainer updates, waking it
(``LLM.wake_up``) for the next rollout. The on-policy guard (``rollout.max_logprob_drift``) stops a run
whose engine does not follow the policy.

Colocated under torchrun, every rank runs its own engine on its own GPU (vLLM's ``external_launcher``
executor; tensor parallel size 1: each rank samples its own prompts; with ``actor.tensor_parallel_size`` T the
engines of a tensor-parallel group are one engine split T ways, and each rank's push of a full tensor is cut to
its part by vLLM's weight loaders). The engine reports the log-probs of
the distribution it sampled from (``logprobs_mode="processed_logprobs"``: after temperature, top-k, top-p),
which is what the trainer's importance ratios and drift check compare against.

Prompts with images (a vision-language policy) go in vLLM's multimodal format: the ids with one image pad per
image and the row's PIL images, which vLLM's processor expands again (:mod:`verl.rollout.vllm_images`); the
policy's vision tokens get a logit bias that keeps them out of every response, as our sampler does.

The calls here were checked against vLLM 0.33.0's source: ``vllm/entrypoints/llm.py`` (``LLM.__init__``,
``generate``, ``sleep``, ``wake_up``, ``reset_prefix_cache``), ``vllm/engine/arg_utils.py`` (``EngineArgs``:
``distributed_executor_backend``, ``max_model_len``, ``enable_sleep_mode``, ``logprobs_mode``),
``vllm/config/parallel.py`` and ``vllm/v1/executor/uniproc_executor.py`` (``ExecutorWithExternalLauncher``
reads RANK/LOCAL_RANK, and binds cuda:LOCAL_RANK), ``vllm/v1/worker/gpu_worker.py`` (sleep level 2 keeps the
buffers, discards the weights), ``vllm/sampling_params.py``. The test stand-in copies those signatures
(tests/rollout/test_vllm_sync.py); this module has not yet been run against a real vLLM on a GPU
(tests/gpu/test_gpu_vllm.py does, where a GPU and vllm are present).

Supported vLLM: ``VLLM_SUPPORTED`` (the ``vllm`` extra in pyproject.toml says the same). The floor is 0.10.2, the
first release whose ``logprobs_mode="processed_logprobs"`` returns the log-probs after temperature, top-k and
top-p (0.10.0 added ``logprobs_mode``, vLLM PR #21398; PR #22387 made "processed" mean the final distribution);
everything else called here (``external_launcher``, ``enable_sleep_mode``, ``sleep(level)``, ``wake_up(tags)``,
``reset_prefix_cache``, the V1 engine's in-process weight loader) is older. The ceiling stops before 0.35,
the first minor release nobody has checked these calls against (vLLM changes its Python API between minor
releases). ``verl doctor`` says when the installed vLLM is outside
the range, or when the installed torch or transformers do not satisfy the installed vLLM's own requirements.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl.errors import ConfigError, DataError, RolloutError, install_hint
from verl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from verl.rollout.vllm_images import VisionTokens, vllm_prompts

VLLM_INSTALL_HINT = install_hint("vllm", "vllm")
# The vLLM versions this module is written and tested against (see the module docstring); pyproject.toml's
# `vllm` extra pins the same range (tests/rollout/test_vllm_sync.py checks they agree).
VLLM_SUPPORTED = ">=0.10.2,<0.35"
_SEED_SPAN = 2**62  # per-request seeds stay below 2**62 + n: vLLM stores them as int64


def _import_vllm() -> Any:
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise ConfigError(
            f"rollout engine 'vllm' needs the vllm package, which is not installed ({exc}). Install it with "
            f"{VLLM_INSTALL_HINT} (needs a CUDA GPU), or use rollout engine 'hf' (our own sampler, runs "
            "everywhere)."
        ) from exc


def launch_kwargs(seed: int, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """How vLLM should place itself in this process: with a torch.distributed group (torchrun), every rank's
    engine on its own GPU through vLLM's ``external_launcher`` executor; in one process, vLLM's default.

    ``external_launcher`` takes the rank and GPU from RANK / LOCAL_RANK (torchrun sets them) and joins the
    process group that is already up; without it every rank's engine would start on GPU 0. With tensor parallel
    size 1 each rank samples its own prompts (vLLM's "external data parallel" layout). With T > 1
    (`actor.tensor_parallel_size`) the engines of T consecutive ranks are one tensor-parallel engine, each
    holding its part of every layer: vLLM relies on them being given the same prompts, sampling parameters and
    seed, so that their deterministic schedules agree (the ranks of a tensor-parallel group of the trainer read
    the same prompts and share their replica's generator). The engine seed differs per replica, like the
    replicas' sampling generators (vllm/config/parallel.py, vllm/v1/executor/uniproc_executor.py, vLLM 0.33.0).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return {"tensor_parallel_size": 1, "seed": seed}
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ConfigError(
            f"rollout.engine=vllm on rank {dist.get_rank()} of {dist.get_world_size()}: vLLM's external_launcher "
            f"executor reads {', '.join(missing)} from the environment, which is not set. Fix: launch with "
            "torchrun (or `verl train --nproc N`), which sets RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.")
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": tensor_parallel_size,
            "seed": seed + dist.get_rank() // tensor_parallel_size}


_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
                "float32": torch.float32, "float": torch.float32}


def _torch_dtype(value: Any) -> torch.dtype | None:
    """vLLM's ``dtype`` argument as a torch dtype; None for ``"auto"`` (or none given): vLLM decides."""
    if isinstance(value, torch.dtype):
        return value
    return _DTYPE_NAMES.get(str(value).removeprefix("torch.")) if value is not None else None


def _model_config(model_path: str) -> Any:
    """The policy's config where the caller passed none: the folder's config.json, else the hub's as cached
    (never downloaded here); None when neither is there (the engine then takes the model as text-only)."""
    local = Path(model_path).expanduser() / "config.json"
    try:
        if local.is_file():
            return json.loads(local.read_text())
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None


def _free_cached_cuda_memory() -> None:
    """Hand the trainer's cached-but-free CUDA blocks back before vLLM re-allocates its weights and KV cache
    (vLLM allocates through its own pool, which cannot reuse PyTorch's cache)."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class VLLMEngine(RolloutEngine):
    """Rollouts with ``vllm.LLM`` loaded from ``model_path`` (a local directory or hub id).

    ``sleep_mode`` (default on) discards vLLM's KV cache and weights between rollouts, for an engine
    colocated with the trainer (the weights are pushed again before every rollout). ``gpu_memory_utilization``,
    ``max_model_len`` and ``enforce_eager`` are vLLM's (``rollout.vllm.*``); ``seed`` is the run's. Extra
    keyword arguments go to ``vllm.LLM`` (e.g. ``dtype``). ``dtype`` (the trainer passes the rollout's compute
    dtype) is also what pushed weights are cast to before they are gathered (``weight_dtype``; None with vLLM's
    ``"auto"``: pushed as the policy holds them, cast by vLLM's loader).

    Seeds. vLLM (0.10.2 to 0.34, ``vllm/sampling_params.py`` and the V1 sampler) draws a request's sampling
    noise from its ``SamplingParams.seed`` and the token's position (the V1 runner: one generator per seeded
    request, one draw per position; the GPU model runner v2: Gumbel noise keyed by (seed, position, token)).
    Requests with equal seeds therefore share their noise position by position: equal prompts sample the same
    response, and prompts of equal length sample correlated ones. A request with n > 1 fans out into n
    children seeded ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``). An explicit seed also takes the batch
    off vLLM's fused top-k/top-p sampler (FlashInfer takes no per-request generators). Without a seed, vLLM
    draws the noise from its own generator, seeded once at engine start with ``LLM(seed=...)``.

    So by default (``per_request_seeds=False``) no request carries a seed: every request and every one of its
    n children gets independent noise from vLLM's generator, which this class seeds at start with the run's
    seed (plus the rank under torchrun). A run is as reproducible as vLLM's scheduling allows (same prompts,
    same order, same batch composition), and the fused sampler stays on. ``per_request_seeds=True`` is for a
    user who needs each response reproducible on its own, whatever else vLLM batches with it: request ``i`` of
    a call gets ``base + i * n`` (so its children ``base + i * n + j`` are distinct across the whole call), with
    ``base`` drawn from the trainer's sampling generator (seeded from the run's seed and rank, advanced every
    step, saved with checkpoints), or, without one, derived from (engine seed, call index). That costs the
    fused sampler.
    """

    holds_own_weights = True  # the trainer pushes the policy's weights in (verl.rollout.weight_sync)
    # An asynchronous rollout rank's engine: every delivery is loaded as it arrives (weight_sync.DeliveryReceiver),
    # so a rollout pushes nothing (set by verl.trainer.compose.components.setup_engine).
    fed_by_deliveries = False
    SLEEP_LEVEL = 2  # discard the weights: they are pushed again before every rollout (level 1 copies them out)

    def __init__(self, model_path: str, *, gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 enforce_eager: bool = False, sleep_mode: bool = True, seed: int = 0, per_request_seeds: bool = False,
                 tensor_parallel_size: int = 1, model_config: Any = None, **llm_kwargs: Any) -> None:
        self._vllm = _import_vllm()
        if not isinstance(model_path, str) or not model_path:
            raise ConfigError(f"VLLMEngine needs the model's path or hub id as a string, got {model_path!r}.")
        # The weight loader is reachable only when vLLM's engine core runs in this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.model_path = model_path
        # A vision-language policy's image tokens (None for a text model): prompts with images, vision tokens banned
        self.vision = VisionTokens.of(model_config if model_config is not None else _model_config(model_path))
        self.sleep_mode = sleep_mode
        if sleep_mode:
            llm_kwargs.setdefault("enable_sleep_mode", True)
        if max_model_len is not None:
            llm_kwargs["max_model_len"] = max_model_len
        # The log-probs of the distribution sampled from (temperature, top-k, top-p applied), not the raw
        # model's: the trainer compares them with its own filtered log-probs (vllm/config/model.py).
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        llm_kwargs = {**launch_kwargs(seed, tensor_parallel_size), **llm_kwargs}
        self.per_request_seeds = per_request_seeds
        self.engine_seed = int(llm_kwargs.get("seed") or 0)
        # The dtype vLLM holds its weights in: pushes are cast to it before they are gathered (weight_sync).
        self.weight_dtype = _torch_dtype(llm_kwargs.get("dtype"))
        if isinstance(llm_kwargs.get("dtype"), torch.dtype):  # vLLM's spelling: "bfloat16", "float32", ...
            llm_kwargs["dtype"] = str(llm_kwargs["dtype"]).removeprefix("torch.")
        self._calls = 0  # generate() calls so far: the step part of a per-request seed without a generator
        self.llm = self._vllm.LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization,
                                  enforce_eager=enforce_eager, **llm_kwargs)
        self.asleep = False
        self.weights_discarded = False  # true from a level-2 sleep until the next push
        self.sleep()  # the trainer's first forward/backward should not compete with an idle KV cache

    # ---------------------------------------------------------------- weights and memory
    def _weight_loader(self) -> Any:
        """The model object inside vLLM whose ``load_weights`` takes (name, tensor) pairs."""
        executor = getattr(getattr(self.llm, "llm_engine", None), "model_executor", None)
        worker = getattr(executor, "driver_worker", None)
        for candidate in (worker, getattr(worker, "worker", None)):
            model = getattr(getattr(candidate, "model_runner", None), "model", None)
            if model is not None and hasattr(model, "load_weights"):
                return model
        raise RolloutError(
            f"cannot reach the weight loader of this vLLM ({getattr(self._vllm, '__version__', '?')}) in-process "
            "(llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model.load_weights), so the "
            "policy's updated weights cannot be pushed and it would sample from the initial weights. Fix: run "
            "with VLLM_ENABLE_V1_MULTIPROCESSING=0 (under torchrun for tensor parallelism), or use "
            "rollout.engine=hf.")

    def load_policy_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Wake the weights, load the policy's (name, full tensor) pairs, then wake the KV cache; cached
        prefixes computed with the old weights are dropped. ``weights`` is consumed one pair at a time, so
        a sharded policy needs only one gathered tensor at a time."""
        self.wake_up(["weights"])
        self._weight_loader().load_weights(weights=iter(weights))
        self.weights_discarded = False
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        self.wake_up(["kv_cache"])

    def sleep(self) -> None:
        """Free the KV cache and the weights until the next rollout, whose push reloads them (level 2)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.SLEEP_LEVEL)
            self.asleep, self.weights_discarded = True, True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode and self.asleep:
            _free_cached_cuda_memory()
            self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self.asleep = False

    def _vllm_params(self, params: SamplingParams, seed: int | None) -> Any:
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            top_k=params.top_k or 0,  # 0 = off (vllm/sampling_params.py)
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.eos_token_ids),
            ignore_eos=not params.eos_token_ids,
            logprobs=0,  # the sampled token's logprob only
            seed=seed,
            **({"logit_bias": self.vision.logit_bias} if self.vision is not None and self.vision.unsampled else {}),
        )

    def request_seeds(self, requests: int, n: int, generator: torch.Generator | None) -> list[int] | None:
        """The seed of each request of this call, or None (the default: vLLM's own generator; see the class
        docstring). With ``per_request_seeds``, request ``i`` gets ``base + i * n``: vLLM seeds child ``j`` of it
        ``base + i * n + j``, so no two responses of the call share a seed."""
        call = self._calls
        self._calls += 1
        if not self.per_request_seeds:
            return None
        if generator is not None:  # drawn on the generator's device: a CUDA generator cannot fill a CPU tensor
            base = int(torch.randint(0, _SEED_SPAN, (1,), generator=generator, device=generator.device))
        else:
            base = random.Random(f"verl-vllm:{self.engine_seed}:{call}").randrange(_SEED_SPAN)
        return [(base + i * n) % _SEED_SPAN for i in range(requests)]

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        images: Any = None,
    ) -> RolloutOutput:
        """Sample with vLLM and lay the result out like every other engine. `images`: each prompt's
        (`verl.models.vision_inputs.RowImages` with its `pictures`, or None), sent in vLLM's multimodal format
        (`verl.rollout.vllm_images`); the output keeps the expanded prompt ids the trainer's forwards take."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise DataError(f"generate: input_ids {tuple(input_ids.shape)} and attention_mask "
                            f"{tuple(attention_mask.shape)} must both be [batch, prompt_len].")
        prompts = vllm_prompts(input_ids, attention_mask, images, self.vision)  # a bad row fails before vLLM runs
        if self.weights_discarded:
            raise RolloutError(
                "the vLLM engine's weights were discarded when it last slept (sleep level 2) and nothing was "
                "pushed since, so it would sample from uninitialised memory. Fix: push the policy's weights "
                "first (verl.rollout.weight_sync.synced(engine, model), as the trainer does before every rollout).")
        self.wake_up()  # the KV cache, for a caller that pushed the weights but did not wake it
        seeds = self.request_seeds(len(prompts), params.n, generator)
        sampling = (self._vllm_params(params, None) if seeds is None
                    else [self._vllm_params(params, seed) for seed in seeds])
        results = self.llm.generate(prompts, sampling, use_tqdm=False)
        response, response_mask, logprobs, finished = layout_results(
            results, params.n, params.max_new_tokens, params.resolved_pad_token_id, params.eos_token_ids,
            mask_dtype=attention_mask.dtype)
        device = input_ids.device
        return RolloutOutput(
            prompt_ids=input_ids.repeat_interleave(params.n, dim=0),
            prompt_mask=attention_mask.repeat_interleave(params.n, dim=0),
            response_ids=response.to(device),
            response_mask=response_mask.to(device),
            logprobs=logprobs.to(device),
            finished=finished.to(device),
        )


def layout_results(results: Any, n: int, max_new: int, pad: int, eos_token_ids: Iterable[int], *,
                   mask_dtype: torch.dtype = torch.long
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``RequestOutput`` list as [rows, max_new] tensors: (response ids padded with ``pad``, response mask,
    the sampled tokens' log-probs (0 past a response's end, or where vLLM returned none), finished at an eos).
    Row ``i * n + j`` is completion ``j`` of request ``i``; a completion longer than ``max_new`` is cut.

    The values are gathered into flat Python lists (one pass over the tokens, no tensor indexing) and each
    tensor is built by one ``torch.tensor`` and one masked write: a fixed number of tensor operations per call,
    whatever the number of requests or tokens. (A write per token costs ~262k tensor indexing calls per rank
    and step at 64 prompts x 4k tokens.)"""
    eos = set(eos_token_ids)
    lengths: list[int] = []
    flat_tokens: list[int] = []
    flat_logprobs: list[float] = []
    finished: list[bool] = []
    for result in results:
        outputs = list(result.outputs[:n])
        for j in range(n):  # a request with fewer than n completions leaves its last rows empty
            completion = outputs[j] if j < len(outputs) else None
            tokens = list(completion.token_ids)[:max_new] if completion is not None else []
            lengths.append(len(tokens))
            flat_tokens.extend(tokens)
            entries = completion.logprobs if completion is not None else None
            values = [entry[tok].logprob for tok, entry in zip(tokens, entries, strict=False)] if entries else []
            flat_logprobs.extend(values)
            if len(values) < len(tokens):  # fewer entries than tokens: the rest stay 0, as the layout's padding
                flat_logprobs.extend(itertools.repeat(0.0, len(tokens) - len(values)))
            finished.append(bool(tokens) and tokens[-1] in eos)
    rows = len(lengths)
    response = torch.full((rows, max_new), pad, dtype=torch.long)
    logprobs = torch.zeros((rows, max_new), dtype=torch.float32)
    written = torch.arange(max_new).unsqueeze(0) < torch.tensor(lengths, dtype=torch.long).reshape(rows, 1)
    if flat_tokens:  # rows are prefixes, so the row-major order of `written` is the order of the flat lists
        response[written] = torch.tensor(flat_tokens, dtype=torch.long)
        logprobs[written] = torch.tensor(flat_logprobs, dtype=torch.float32)
    return response, written.to(mask_dtype), logprobs, torch.tensor(finished, dtype=torch.bool)


__all__ = ["VLLMEngine", "VLLM_INSTALL_HINT", "VLLM_SUPPORTED", "launch_kwargs", "layout_results"]
