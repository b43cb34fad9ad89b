"""A bridge to vLLM for GPU rollouts, kept in sync with the policy.

vLLM is optional (``pip install vllm``, needs a CUDA GPU): importing verl never imports it, and asking for
this engine without it installed is a ConfigError that says how to install it (``verl check`` refuses
``rollout.engine=vllm`` without vllm or without CUDA before anything loads).

vLLM loads its own copy of the weights from ``model_path``. The trainer pushes the policy's weights into
it before every rollout (:func:`verl.rollout.weight_sync.synced`: gathered from FSDP shards, LoRA merged)
through vLLM's in-process weight loader (``model.load_weights``), and, colocated with the trainer, puts
it to sleep (``LLM.sleep``: KV cache freed, weights offloaded) while the trainer updates, waking it
(``LLM.wake_up``) for the next rollout. The on-policy guard (``rollout.max_logprob_drift``) stops a run
whose engine does not follow the policy.

What has run where: the mapping, the sync and the sleep/wake protocol are tested against a stand-in with
vLLM's API that keeps its own weights (tests/rollout/test_vllm_sync.py); this module has not yet been run
against a real vLLM on a GPU. vLLM reports the log-probs of the model's raw distribution unless configured
to return processed ones.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

import torch

from verl.errors import ConfigError, DataError, RolloutError, install_hint
from verl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

VLLM_INSTALL_HINT = install_hint("vllm", "vllm")


def _import_vllm() -> Any:
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise ConfigError(
            f"rollout engine 'vllm' needs the vllm package, which is not installed ({exc}). Install it with "
            f"{VLLM_INSTALL_HINT} (needs a CUDA GPU), or use rollout engine 'hf' (our own sampler, runs "
            "everywhere)."
        ) from exc


class VLLMEngine(RolloutEngine):
    """Rollouts with ``vllm.LLM`` loaded from ``model_path`` (a local directory or hub id).

    ``sleep_mode`` (default on) frees vLLM's KV cache and offloads its weights between rollouts, for an
    engine colocated with the trainer. Extra keyword arguments go to ``vllm.LLM`` (e.g. ``dtype``).
    """

    holds_own_weights = True  # the trainer pushes the policy's weights in (verl.rollout.weight_sync)

    def __init__(self, model_path: str, *, gpu_memory_utilization: float = 0.5, sleep_mode: bool = True,
                 **llm_kwargs: Any) -> None:
        self._vllm = _import_vllm()
        if not isinstance(model_path, str) or not model_path:
            raise ConfigError(f"VLLMEngine needs the model's path or hub id as a string, got {model_path!r}.")
        # The weight loader is reachable only when vLLM's engine core runs in this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.model_path = model_path
        self.sleep_mode = sleep_mode
        if sleep_mode:
            llm_kwargs.setdefault("enable_sleep_mode", True)
        self.llm = self._vllm.LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization, **llm_kwargs)
        self.asleep = False
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
            "with VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size=1, or use rollout.engine=hf.")

    def load_policy_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Wake the weights, load the policy's (name, full tensor) pairs, then wake the KV cache; cached
        prefixes computed with the old weights are dropped."""
        self.wake_up(["weights"])
        self._weight_loader().load_weights(weights=iter(weights))
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        self.wake_up(["kv_cache"])

    def sleep(self) -> None:
        """Free the KV cache and offload the weights to host memory (level 1) until the next rollout."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode and self.asleep:
            self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self.asleep = False

    def _vllm_params(self, params: SamplingParams, seed: int | None) -> Any:
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            top_k=params.top_k if params.top_k else -1,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.eos_token_ids),
            ignore_eos=not params.eos_token_ids,
            logprobs=0,  # the sampled token's logprob only
            seed=seed,
        )

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Sample with vLLM and lay the result out like every other engine."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise DataError(f"generate: input_ids {tuple(input_ids.shape)} and attention_mask "
                            f"{tuple(attention_mask.shape)} must both be [batch, prompt_len].")
        seed = None
        if generator is not None:
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        self.wake_up()  # a caller that did not push weights first still gets an awake engine
        mask = attention_mask.bool().cpu()
        ids = input_ids.cpu()
        prompts = [{"prompt_token_ids": ids[i][mask[i]].tolist()} for i in range(ids.shape[0])]
        results = self.llm.generate(prompts, self._vllm_params(params, seed), use_tqdm=False)

        n, max_new, pad = params.n, params.max_new_tokens, params.resolved_pad_token_id
        rows = ids.shape[0] * n
        response = torch.full((rows, max_new), pad, dtype=torch.long)
        logprobs = torch.zeros((rows, max_new), dtype=torch.float32)
        response_mask = torch.zeros((rows, max_new), dtype=attention_mask.dtype)
        finished = torch.zeros(rows, dtype=torch.bool)
        eos = set(params.eos_token_ids)
        for i, result in enumerate(results):
            for j, completion in enumerate(result.outputs[:n]):
                row = i * n + j
                tokens = list(completion.token_ids)[:max_new]
                length = len(tokens)
                response[row, :length] = torch.tensor(tokens, dtype=torch.long)
                response_mask[row, :length] = 1
                if completion.logprobs:
                    for t, (tok, entry) in enumerate(zip(tokens, completion.logprobs, strict=False)):
                        logprobs[row, t] = float(entry[tok].logprob)
                finished[row] = bool(tokens) and tokens[-1] in eos
        device = input_ids.device
        return RolloutOutput(
            prompt_ids=input_ids.repeat_interleave(n, dim=0),
            prompt_mask=attention_mask.repeat_interleave(n, dim=0),
            response_ids=response.to(device),
            response_mask=response_mask.to(device),
            logprobs=logprobs.to(device),
            finished=finished.to(device),
        )


__all__ = ["VLLMEngine", "VLLM_INSTALL_HINT"]
