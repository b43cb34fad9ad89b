"""A thin bridge to vLLM for GPU rollouts.

vLLM is an optional extra (``pip install vllm``, or ``pip install -e '.[vllm]'`` from a checkout): importing verl never imports it, and asking
for this engine without it installed is a ConfigError that says how to install it.

This shim is NOT exercised by verl's test suite: vLLM needs a GPU and is not installed in CI. It only
maps our :class:`SamplingParams` onto ``vllm.SamplingParams`` and vLLM's outputs onto
:class:`RolloutOutput`. Two known differences from :class:`HFKVCacheEngine`: vLLM reports logprobs of
the model's distribution unless it is configured to return processed logprobs, and it loads its own
copy of the weights from ``model_path``, so the trainer must sync updated weights into it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from verl.errors import ConfigError, DataError
from verl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

VLLM_INSTALL_HINT = "pip install vllm  (from a verl checkout: pip install -e '.[vllm]')"


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

    Extra keyword arguments go to ``vllm.LLM`` (e.g. ``tensor_parallel_size``, ``dtype``).
    """

    def __init__(self, model_path: str, *, gpu_memory_utilization: float = 0.5, **llm_kwargs: Any) -> None:
        self._vllm = _import_vllm()
        if not isinstance(model_path, str) or not model_path:
            raise ConfigError(f"VLLMEngine needs the model's path or hub id as a string, got {model_path!r}.")
        self.model_path = model_path
        self.llm = self._vllm.LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization, **llm_kwargs)

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
