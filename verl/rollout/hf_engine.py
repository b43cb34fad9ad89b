"""Our own batched sampler on any Hugging Face causal LM, with a KV cache.

Why not ``model.generate``: for RL we need the sampling logprobs, a fixed output layout and speed on
small batches of short responses, where ``generate`` spends most of its time in per-step Python
(logits processors, stopping criteria, mask rebuilding). This loop does one prefill, then one
one-token forward per step with

* a KV cache preallocated for prompt + ``max_new_tokens`` (written in place, no per-step concat),
* the decode attention mask built once and sliced per step (a ready 4D mask, where the attention
  implementation takes one, so the model does not rebuild it),
* logits only for the last position,
* rows that hit an eos id dropped from the batch and the cache, so finished sequences cost nothing,
* the prompt prefilled once and its cache repeated ``n`` times for ``n`` samples per prompt.

Greedy output equals ``model.generate(do_sample=False)`` token for token (tested).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from verl.errors import ConfigError, DataError, ModelError
from verl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from verl.rollout.fast_decode import LlamaStyleDecodeStep
from verl.rollout.sampling import sample_step
from verl.utils.positions import position_ids_from_mask

try:  # transformers >= 4.56 has per-layer caches; older versions use a plain DynamicCache.
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    from transformers.cache_utils import DynamicCache

    Cache = DynamicLayer = None  # type: ignore[assignment,misc]


if DynamicLayer is not None:

    class _PreallocatedLayer(DynamicLayer):
        """A full-attention cache layer with room for the whole rollout, written in place.

        ``DynamicLayer`` concatenates on every step, copying the whole cache each time; here a step
        writes one slot and returns views of the filled part.
        """

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                                **kwargs: Any) -> None:
            batch, heads, _, head_dim = key_states.shape
            self.device = key_states.device
            self.key_buf = key_states.new_empty(batch, heads, self.capacity, head_dim)
            self.value_buf = value_states.new_empty(batch, value_states.shape[1], self.capacity,
                                                    value_states.shape[-1])
            self.is_initialized = True

        def _refresh_views(self) -> None:
            self.keys = self.key_buf[:, :, : self.length]
            self.values = self.value_buf[:, :, : self.length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, stop = self.length, self.length + key_states.shape[-2]
            if stop > self.capacity:
                raise ModelError(f"rollout KV cache overflow: {stop} positions for a cache of {self.capacity}; "
                                 "the model was called more often than the rollout planned; please report it.")
            self.key_buf[:, :, start:stop] = key_states
            self.value_buf[:, :, start:stop] = value_states
            self.length = stop
            self._refresh_views()
            return self.keys, self.values

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return self.length

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.key_buf = self.key_buf.index_select(0, indices)
                self.value_buf = self.value_buf.index_select(0, indices)
                self._refresh_views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buf = self.key_buf.repeat_interleave(repeats, dim=0)
                self.value_buf = self.value_buf.repeat_interleave(repeats, dim=0)
                self._refresh_views()

        def reset(self) -> None:
            self.length = 0
            self.is_initialized = False
            self.keys = self.values = None

    class _RolloutCache(DynamicCache):
        """A ``DynamicCache`` (so models treat it as one) whose layers are preallocated."""

        def __init__(self, num_layers: int, capacity: int) -> None:
            Cache.__init__(self, layers=[_PreallocatedLayer(capacity) for _ in range(num_layers)])


def _full_attention_only(config: Any) -> bool:
    """True when every layer attends to the whole past (no sliding window, no linear attention)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or not getattr(config, "use_sliding_window", True)


class HFKVCacheEngine(RolloutEngine):
    """Batched sampling on a Hugging Face causal LM (``AutoModelForCausalLM``-style ``forward``).

    ``fast_decode`` runs decode steps through :class:`LlamaStyleDecodeStep` when the model qualifies
    (Llama/Qwen2/Qwen3/Mistral without sliding windows or module hooks); ``fast_decode_reason`` says
    why a model does not. ``prebuilt_masks=False`` lets the model build its attention mask every step
    from a 2D mask on the plain ``forward`` path, for models with unusual mask logic; the default uses
    a ready 4D mask where it is known to be exact (sdpa and eager attention on full-attention models).
    """

    def __init__(self, model: torch.nn.Module, *, fast_decode: bool = True, prebuilt_masks: bool = True) -> None:
        config = getattr(model, "config", None)
        if config is None or not callable(model):
            raise ModelError(f"HFKVCacheEngine needs a Hugging Face causal LM with a .config, got "
                             f"{type(model).__name__}; load it with AutoModelForCausalLM.from_pretrained.")
        if getattr(config, "is_encoder_decoder", False):
            raise ModelError(f"HFKVCacheEngine samples from decoder-only models; {type(model).__name__} is an "
                             "encoder-decoder model. Use a causal LM (AutoModelForCausalLM).")
        self.model = model
        self.config = config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.text_config = text_config
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params
        attn = getattr(config, "_attn_implementation", None)
        full = _full_attention_only(text_config)
        self._mask_kind = attn if (prebuilt_masks and full and attn in ("sdpa", "eager")) else "2d"
        self.preallocates = DynamicLayer is not None and full  # full attention: a preallocated cache serves
        self._fast_decode = fast_decode
        self._decode_step: LlamaStyleDecodeStep | None = None  # kept: its weight layout serves many rollouts

    @property
    def fast_decode_reason(self) -> str:
        """Empty when decode steps take the fast path, else why they use the model's ``forward``."""
        if not self._fast_decode:
            return "fast_decode=False"
        if not self.preallocates:
            return "the model needs a cache layout other than full attention"
        return LlamaStyleDecodeStep.supports(self.model)[1]

    # -- helpers ---------------------------------------------------------------------------------
    def _vocab_size(self) -> int:
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        if emb is not None and hasattr(emb, "num_embeddings"):
            return int(emb.num_embeddings)
        return int(self.text_config.vocab_size)

    # The public methods below are what the multi-turn rollout (`verl.rollout.multiturn`) drives the same
    # model with: the input checks, the model's own cache, one cached forward, `preallocates`.
    def check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams) -> None:
        """Refuse inputs `generate` cannot sample from, with what is wrong and the fix."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"generate(params=...) takes a verl.rollout.SamplingParams, got "
                              f"{type(params).__name__}; build one with SamplingParams(temperature=..., ...).")
        if input_ids.dim() != 2:
            raise DataError(f"generate: input_ids must be 2D [batch, prompt_len], got shape "
                            f"{tuple(input_ids.shape)}; batch single prompts with input_ids.unsqueeze(0).")
        if attention_mask.shape != input_ids.shape:
            raise DataError(f"generate: attention_mask shape {tuple(attention_mask.shape)} does not match "
                            f"input_ids shape {tuple(input_ids.shape)}; pass the mask the tokenizer returned "
                            "with these ids.")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise DataError(f"generate: empty batch (input_ids shape {tuple(input_ids.shape)}); "
                            "pass at least one prompt with at least one token.")
        if input_ids.dtype.is_floating_point:
            raise DataError(f"generate: input_ids must be integer token ids, got dtype {input_ids.dtype}.")
        mask = attention_mask.bool()
        empty = (~mask.any(dim=1)).nonzero().flatten()
        if empty.numel():
            raise DataError(f"generate: prompt row {int(empty[0])} has no real tokens (attention_mask is all 0); "
                            "drop empty prompts before rollout.")
        right = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1).nonzero().flatten()
        if right.numel():
            raise DataError(f"generate: prompt row {int(right[0])} is not left-padded (its attention_mask has a "
                            "0 after a 1). Set tokenizer.padding_side = 'left' before tokenizing prompts for "
                            "generation.")
        vocab = self._vocab_size()
        real = input_ids.masked_fill(~mask, 0)
        bad = ((real < 0) | (real >= vocab)).nonzero()
        if bad.numel():
            r, c = int(bad[0, 0]), int(bad[0, 1])
            raise DataError(f"generate: token id {int(input_ids[r, c])} at prompt row {r}, column {c} is outside "
                            f"the model's vocabulary [0, {vocab}); the tokenizer does not match the model.")
        bad_eos = [e for e in params.eos_token_ids if e >= vocab]
        if bad_eos:
            raise ConfigError(f"SamplingParams.eos_token_ids {bad_eos} are outside the model's vocabulary "
                              f"[0, {vocab}); take them from the tokenizer that belongs to this model.")
        limit = getattr(self.text_config, "max_position_embeddings", None)
        total = input_ids.shape[1] + params.max_new_tokens
        if isinstance(limit, int) and total > limit:
            raise ConfigError(f"prompt length {input_ids.shape[1]} + max_new_tokens {params.max_new_tokens} = "
                              f"{total} exceeds the model's max_position_embeddings {limit}; lower "
                              "max_new_tokens or the maximum prompt length.")

    def new_cache(self) -> Any:
        """The model's own cache layout (sliding-window layers included) where transformers knows it."""
        try:
            return DynamicCache(config=self.config)
        except TypeError:  # transformers < 4.56 builds the layout lazily
            return DynamicCache()

    def forward_step(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """One forward of `ids` on `cache`; the logits after the last column ([B, V])."""
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        return out.logits[:, -1, :]

    # -- the sampler -----------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt; tensors come back on the model's device."""
        self.check_inputs(input_ids, attention_mask, params)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                return self._generate(input_ids, attention_mask, params, generator)
        finally:
            self.model.train(was_training)

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> RolloutOutput:
        param = next(self.model.parameters())
        device, dtype = param.device, param.dtype
        input_ids = input_ids.to(device=device, dtype=torch.long)
        prompt_mask = attention_mask.to(device=device)
        mask_bool = prompt_mask.bool()
        batch, prompt_len = input_ids.shape
        n, max_new = params.n, params.max_new_tokens
        rows = batch * n
        pad_id = params.resolved_pad_token_id
        temperature, top_k, top_p = float(params.temperature), params.top_k, float(params.top_p)

        # Prefill each prompt once; the cache is repeated for the n samples afterwards.
        cache = (_RolloutCache(int(self.text_config.num_hidden_layers), prompt_len + max_new)
                 if self.preallocates else self.new_cache())
        positions = position_ids_from_mask(mask_bool)  # prompts are left-padded and non-empty (checked)
        feed = input_ids.masked_fill(~mask_bool, 0)
        logits = self.forward_step(feed, mask_bool.long(), positions, cache)
        next_pos = positions[:, -1:] + 1  # [batch, 1]: position of the first response token
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            next_pos = next_pos.repeat_interleave(n, dim=0)
            mask_bool = mask_bool.repeat_interleave(n, dim=0)

        fast = None
        if not self.fast_decode_reason:
            if self._decode_step is None:
                self._decode_step = LlamaStyleDecodeStep(self.model)
            fast = self._decode_step
            fast.prepare(prompt_len + max_new, device, dtype)
        # The decode mask for the whole rollout, built once and sliced per step.
        decode_mask = torch.cat([mask_bool, mask_bool.new_ones(rows, max_new)], dim=1)
        if fast is not None:  # additive, as sdpa would turn a boolean mask into in every layer of every step
            decode_mask = torch.zeros(decode_mask.shape, dtype=dtype, device=device).masked_fill_(
                ~decode_mask, float("-inf"))[:, None, None, :]
        elif self._mask_kind == "sdpa":
            decode_mask = decode_mask[:, None, None, :]
        elif self._mask_kind == "eager":
            zero = torch.zeros((), dtype=dtype, device=device)
            decode_mask = torch.where(decode_mask, zero, torch.finfo(dtype).min)[:, None, None, :]
        else:
            decode_mask = decode_mask.long()

        response = torch.full((rows, max_new), pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((rows,), max_new, dtype=torch.long, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        eos = torch.tensor(params.eos_token_ids, dtype=torch.long, device=device) if params.eos_token_ids else None
        active = torch.arange(rows, device=device)  # original row of each row still being sampled
        compacted = False

        for step in range(max_new):
            tokens, token_logp = sample_step(logits, temperature, top_k, top_p, generator)
            if compacted:
                response[active, step] = tokens
                logprobs[active, step] = token_logp.float()
            else:
                response[:, step] = tokens
                logprobs[:, step] = token_logp
            if eos is not None:
                hit = torch.isin(tokens, eos)
                if bool(hit.any()):
                    done_rows = active[hit]
                    finished[done_rows] = True
                    lengths[done_rows] = step + 1
                    keep = (~hit).nonzero().flatten()
                    if keep.numel() == 0:
                        break
                    active, tokens, next_pos = active[keep], tokens[keep], next_pos[keep]
                    decode_mask = decode_mask[keep]
                    cache.batch_select_indices(keep)
                    compacted = True
            if step == max_new - 1:
                break
            kv_len = prompt_len + step + 1
            step_mask = decode_mask[..., :kv_len]
            if fast is not None:
                logits = fast(tokens, next_pos.squeeze(-1), step_mask, cache)
            else:
                logits = self.forward_step(tokens.unsqueeze(-1), step_mask, next_pos, cache)
            next_pos = next_pos + 1

        response_mask = (torch.arange(max_new, device=device) < lengths.unsqueeze(-1)).to(prompt_mask.dtype)
        if n > 1:
            input_ids = input_ids.repeat_interleave(n, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        return RolloutOutput(
            prompt_ids=input_ids,
            prompt_mask=prompt_mask,
            response_ids=response,
            response_mask=response_mask,
            logprobs=logprobs,
            finished=finished,
        )


__all__ = ["HFKVCacheEngine"]
