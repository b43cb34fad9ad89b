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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from verl.errors import ConfigError, DataError, ModelError
from verl.models.signature import full_attention_only
from verl.models.vision import unsampled_token_ids
from verl.models.vision_inputs import RowImages, has_images, image_forward_inputs
from verl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from verl.rollout.fast_decode import LlamaStyleDecodeStep
from verl.rollout.kv_cache import DynamicLayer, Parked, RolloutCache, model_cache
from verl.rollout.sampling import sample_step
from verl.utils.cpu_matmul import CpuMatmul
from verl.utils.positions import position_ids_from_mask


@dataclass
class Decoding:
    """A batch between model calls: its cache, the logits after each row's latest token, which cache
    columns are real tokens (the rest are left padding and holes) and each row's next position id."""

    cache: Any
    logits: torch.Tensor  # [B, V]
    mask: torch.Tensor  # [B, C] bool
    next_pos: torch.Tensor  # [B]

    def repeat(self, n: int) -> None:
        """Each row n times in a row (n samples of one prompt)."""
        if n > 1:
            self.cache.batch_repeat_interleave(n)
            self.logits, self.mask, self.next_pos = (t.repeat_interleave(n, dim=0)
                                                     for t in (self.logits, self.mask, self.next_pos))

    def select(self, rows: torch.Tensor) -> None:
        """Keep these rows, in this order."""
        if len(rows) < self.mask.shape[0] or bool((rows != torch.arange(len(rows), device=rows.device)).any()):
            self.cache.batch_select_indices(rows)
            self.logits, self.mask, self.next_pos = self.logits[rows], self.mask[rows], self.next_pos[rows]


@dataclass
class Decoded:
    """What `HFKVCacheEngine.decode` sampled, per row of the batch."""

    tokens: torch.Tensor  # [B, steps], pad after each row's end
    logprobs: torch.Tensor  # [B, steps] float32, 0 after the end
    lengths: torch.Tensor  # [B] tokens written, the ending one included
    eos: torch.Tensor  # [B] ended by an eos id


# Asked which of some rows (a CPU tensor of indices into the batch) end at a step, given a host copy of the
# [B, step + 1] tokens so far; a bool per row.
EndCheck = Callable[[torch.Tensor, int, torch.Tensor], Any]
# Told which rows (indices into the batch) finished, with the [B, steps] tokens and [B] lengths so far.
RowsFinished = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _to_host(t: torch.Tensor) -> list:
    """The decode's read of device values on the host: off the CPU a sync, which waits for the queued steps."""
    return t.tolist()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class _HostEnds:
    """The host's side of `decode(end=...)`: which rows ended, settled for a window of steps at a time.

    Between checks the device samples on for every row of the batch. At a check the host reads the tokens of
    the steps since the last one (one sync) and walks them a step at a time, as a decode that checked every
    token would: a row ends at its first eos id, or where `end` says so of the rows still running, asked
    with the host's copy of the tokens up to that step (asking costs no sync). The caller rolls back what
    rows sampled after their end.
    """

    def __init__(self, end: EndCheck, eos_ids: list[int], pad: int, rows: int, steps: int) -> None:
        self.end, self.eos, self.pad = end, frozenset(eos_ids), pad
        self.tokens = torch.full((rows, steps), pad, dtype=torch.long)  # the host's copy, final up to `start`
        self.rows = list(range(rows))  # the rows (indices into the batch) still sampling, in the batch's order
        self.start = 0  # the first step not settled
        self.by_eos: list[int] = []  # of the last settle: 1 where a row ended at an eos id

    def settle(self, step: int, window: list[list[int]]) -> list[int] | None:
        """The tokens `window` of `self.rows` at steps start..step: the step each row ended at (-1 where it
        runs on), None when none did. The rows that ended leave `self.rows`."""
        lo, self.start = self.start, step + 1
        rows, width = self.rows, step + 1 - lo
        index = torch.tensor(rows, dtype=torch.long)
        self.tokens[index, lo: step + 1] = torch.tensor(window, dtype=torch.long).reshape(len(rows), width)
        ended, by_eos = [-1] * len(rows), [0] * len(rows)
        running = list(range(len(rows)))
        for s in range(lo, step + 1):
            ask = []
            for i in running:
                if window[i][s - lo] in self.eos:
                    ended[i], by_eos[i] = s, 1
                else:
                    ask.append(i)
            if ask:
                says = self.end(index[ask], s, self.tokens[:, : s + 1])
                for i, yes in zip(ask, torch.as_tensor(says).tolist(), strict=True):
                    if yes:
                        ended[i] = s
            now = [i for i in running if ended[i] == s]
            if now:
                self.tokens[index[now], s + 1: step + 1] = self.pad  # what they sampled after their end
                running = [i for i in running if ended[i] < 0]
                if not running:
                    break
        if len(running) == len(rows):
            return None
        self.rows = [rows[i] for i in running]
        self.by_eos = by_eos
        return ended


class HFKVCacheEngine(RolloutEngine):
    """Batched sampling on a Hugging Face causal LM (``AutoModelForCausalLM``-style ``forward``).

    ``fast_decode`` runs decode steps through :class:`LlamaStyleDecodeStep` when the model qualifies
    (Llama/Qwen2/Qwen3/Mistral without sliding windows or module hooks); ``fast_decode_reason`` says
    why a model does not. ``prebuilt_masks=False`` lets the model build its attention mask every step
    from a 2D mask on the plain ``forward`` path, for models with unusual mask logic; the default uses
    a ready 4D mask where it is known to be exact (sdpa and eager attention on full-attention models).
    ``eos_check_every`` is how many tokens pass between the host's checks for ended rows (each a device
    sync), by an eos id or by a decode's `end` callback (multi-turn stop strings); the default is 1 on CPU,
    where a check is free and dropping ended rows early saves compute, and 8 on accelerators. The rollout
    does not depend on it (but for the rounding of batched kernels that change with the batch's size).
    """

    def __init__(self, model: torch.nn.Module, *, fast_decode: bool = True, prebuilt_masks: bool = True,
                 eos_check_every: int | None = None, cpu_matmul: CpuMatmul = "aten") -> None:
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
        full = full_attention_only(text_config)
        self._mask_kind = attn if (prebuilt_masks and full and attn in ("sdpa", "eager")) else "2d"
        self.preallocates = DynamicLayer is not None and full  # full attention: a preallocated cache serves
        self._fast_decode = fast_decode
        if eos_check_every is not None and (not isinstance(eos_check_every, int) or eos_check_every < 1):
            raise ConfigError(f"eos_check_every must be a positive number of tokens, got {eos_check_every!r}.")
        self.eos_check_every = eos_check_every
        self._decode_step: LlamaStyleDecodeStep | None = None  # kept: its weight layout serves many rollouts
        self.cpu_matmul = cpu_matmul  # the library plain layers decode with on CPU (`auto`: LlamaStyleDecodeStep's)
        # A vision-language model's vision tokens: never sampled (None: a text model)
        banned = unsampled_token_ids(model)
        self.banned_ids = torch.tensor(banned, dtype=torch.long) if banned else None
        # Called after each sampled token, before the next forward, with the token's step; True when the
        # weights changed under the decode (an asynchronous rollout's delivery: a partial rollout), so the
        # tokens from the next one on are sampled by the new weights.
        self.between_tokens: Callable[[int], bool] | None = None
        # Called by `generate` as rows finish, with the newly finished rows (indices into its output, a [k]
        # tensor), the [B, max_new_tokens] token buffer and the [B] lengths, final for those rows: after the
        # step where they sampled an eos (on an accelerator, at the next eos check) and, for rows that ran to
        # max_new_tokens, at the end. The caller can start on a response (score it) before the batch is done.
        self.on_rows_finished: RowsFinished | None = None

    @property
    def decode_matmul(self) -> tuple[str, str] | None:
        """The library the fast decode step multiplies plain layers with on CPU, and why (`cpu_matmul`); None
        before the first rollout on the fast step."""
        step = self._decode_step
        return None if step is None or step.kernel is None else (step.kernel, step.kernel_why)

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

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 **images: Any) -> torch.Tensor:
        """One forward of `ids` on `cache` (`images`: a prefill's pixels, grids and multimodal positions); the
        logits after the last column ([B, V]), where vision tokens are never sampled."""
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs, **images)
        logits = out.logits[:, -1, :]
        # A tensor-parallel head's logits are sharded over the vocabulary: the sampler takes them whole (the ranks
        # of its group sample alike, from the same generator state).
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        # A vision token in a response would have no pixels behind it (the next forward with it fails).
        if self.banned_ids is None:
            return logits
        if self.banned_ids.device != logits.device:  # moved once, not copied to the device every token
            self.banned_ids = self.banned_ids.to(logits.device)
        return logits.index_fill(1, self.banned_ids, -float("inf"))

    # -- the decode loop, shared by single-turn sampling and multi-turn episodes --------------------
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int,
                images: Sequence[RowImages | None] | None = None) -> Decoding:
        """Run left-padded prompts [B, P] through the model onto a fresh cache with room for `capacity`
        positions (it grows past that when needed). Call inside ``torch.inference_mode()``. `images`: each
        row's (a vision-language model), whose pad tokens the prompt holds: they take multimodal rotary
        positions, and the text after them continues past the largest, so every new token's position is
        one 1-D number again, as for text."""
        device = next(self.model.parameters()).device
        ids = input_ids.to(device=device, dtype=torch.long)
        mask = attention_mask.to(device=device).bool()
        cache = (RolloutCache(int(self.text_config.num_hidden_layers), capacity) if self.preallocates
                 else model_cache(self.config))
        extra = image_forward_inputs(self.model, ids, mask.long(), images)
        positions = extra.pop("position_ids", None)
        if positions is None:
            positions = position_ids_from_mask(mask)  # prompts are left-padded and non-empty (checked)
        logits = self._forward(ids.masked_fill(~mask, 0), mask.long(), positions, cache, **extra)
        last = positions[..., -1] if positions.dim() == 2 else positions[..., -1].amax(0)  # a text token's
        return Decoding(cache=cache, logits=logits, mask=mask, next_pos=last + 1)

    def extend(self, state: Decoding, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Feed a block of tokens [B, W] to every row; each row's real tokens (`mask`) are right-aligned,
        behind holes, so the block's last column is every row's latest token."""
        positions = state.next_pos.unsqueeze(1) + (mask.long().cumsum(1) - 1).clamp(min=0)
        state.mask = torch.cat([state.mask, mask], dim=1)
        state.logits = self._forward(ids, state.mask.long(), positions, state.cache)
        state.next_pos = state.next_pos + mask.long().sum(1)

    def decode(self, state: Decoding, params: SamplingParams, steps: int, generator: torch.Generator | None = None,
               *, keep: bool = False, end: EndCheck | None = None, finished: RowsFinished | None = None,
               noise: torch.Tensor | None = None) -> Decoded:
        """Sample up to `steps` tokens per row of `state`. A row ends at an eos id, when `end` says so, or
        after `steps` tokens; ended rows leave the decode batch, so they cost nothing.

        `end(rows, step, tokens)` is asked about the rows (a CPU tensor of indices into the batch) still running
        at `step` that sampled a token other than eos there; `tokens` is a host copy of the [B, step + 1] tokens
        so far. It may be asked some tokens late, about several steps in a row (see `eos_check_every`), and
        answers with a bool per row. With ``keep``, the ended rows' cache rows are set aside and every row is
        back in `state` afterwards, in its place, with the tokens it wrote on the cache except its last one
        (the caller feeds it, with what follows it); without, `state` is used up. `finished(rows, tokens,
        lengths)` is told of each row once, when its tokens are final (see `on_rows_finished`). Call inside
        ``torch.inference_mode()``. `noise` [steps, B] gives each row's uniform number for each step instead of
        the generator (see below).
        """
        cache, logits, next_pos = state.cache, state.logits, state.next_pos
        device, rows, width = logits.device, logits.shape[0], state.mask.shape[1]
        temperature, top_k, top_p = float(params.temperature), params.top_k, float(params.top_p)
        pad = params.resolved_pad_token_id
        tokens = torch.full((rows, steps), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        lengths = torch.full((rows,), steps, dtype=torch.long, device=device)
        eos_hit = torch.zeros(rows, dtype=torch.bool, device=device)
        eos = torch.tensor(params.eos_token_ids, dtype=torch.long, device=device) if params.eos_token_ids else None
        parks = keep and hasattr(cache, "park")
        holes = keep and not parks  # a model-layout cache cannot set rows aside: ended rows feed masked holes
        max_positions = int(next_pos.max()) + steps
        fast = None if holes else self._fast_step(max_positions, rows)
        mask = self._decode_mask(torch.cat([state.mask, state.mask.new_ones(rows, steps)], dim=1),
                                 fast is not None, holes)
        live = torch.arange(rows, device=device)  # the row of `tokens` each cache row belongs to
        compacted = False  # whether rows have left the batch (else `live` is every row, in order)
        sampling = live if holes else None  # holes only: the rows still writing, in order
        writing = torch.ones(rows, dtype=torch.bool, device=device)  # holes only: the same, as a mask
        parked: list[Parked] = []
        parked_rows: list[torch.Tensor] = []
        # Which rows ended is a host sync; off the CPU the host learns of it every `every` tokens. Rows that
        # ended in between are computed on: they write padding (an eos, known on the device) or what they
        # write is rolled back when the host has asked `end` about the steps since the last check. A model-
        # layout cache (holes) keeps every column it is fed, so it is checked every token.
        every = 1 if holes else (self.eos_check_every or (1 if device.type == "cpu" else 8))
        ends = _HostEnds(end, params.eos_token_ids, pad, rows, steps) if end is not None else None
        stopped = torch.zeros(rows, dtype=torch.bool, device=device) if every > 1 and ends is None else None
        told = torch.zeros(rows, dtype=torch.bool, device=device) if finished is not None else None
        # With `end`, row r samples step t with its own uniform number noise[t, r], drawn for every row and
        # step up front: what the generator gives a row then does not depend on when others left the batch,
        # nor on how many steps the batch was computed past its end.
        if noise is not None and tuple(noise.shape) != (steps, rows):
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected ({steps}, {rows}): steps x rows")
        if temperature == 0:
            noise = None
        elif noise is None and ends is not None:
            noise = torch.rand((steps, rows), generator=generator, device=device,
                               dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)

        for step in range(steps):
            at = live if sampling is None else sampling  # the rows of `tokens` sampled at this step
            tok, logp = sample_step(logits if sampling is None else logits[sampling], temperature, top_k, top_p,
                                    generator, None if noise is None else noise[step][at])
            if stopped is not None:  # rows that ended since the last check write padding
                tok, logp = tok.masked_fill(stopped, pad), logp.masked_fill(stopped, 0.0)
            if compacted or holes:
                tokens[at, step], logprobs[at, step] = tok, logp.float()
            else:
                tokens[:, step], logprobs[:, step] = tok, logp
            done = go = gone = None  # which rows of `at` ended ([A] bool), the others' places, theirs
            if ends is not None:
                if step + 1 - ends.start >= every or step == steps - 1:
                    lo = ends.start
                    cols = slice(lo, step + 1)
                    ended = ends.settle(step, _to_host(tokens[at, cols] if compacted or holes else tokens[:, cols]))
                    if ended is not None:  # the step each row of `at` ended at, -1 for the running ones
                        go_h = [i for i, s in enumerate(ended) if s < 0]
                        n, m = len(ended), len(ended) + len(go_h)
                        packed = _to_device([*ended, *ends.by_eos, *go_h, *(i for i, s in enumerate(ended) if s >= 0)],
                                            device)
                        at_end, by_eos, go, gone = (packed[:n], packed[n: 2 * n].bool(), packed[2 * n: n + m],
                                                    packed[n + m:])
                        done = at_end >= 0
                        # What rows sampled after their end: padding and log-prob 0, as if never sampled.
                        past = (torch.arange(lo, step + 1, device=device) > at_end.unsqueeze(1)) & done.unsqueeze(1)
                        if compacted or holes:
                            tokens[at, cols] = tokens[at, cols].masked_fill(past, pad)
                            logprobs[at, cols] = logprobs[at, cols].masked_fill(past, 0.0)
                        else:
                            tokens[:, cols].masked_fill_(past, pad)
                            logprobs[:, cols].masked_fill_(past, 0.0)
                        lengths[at] = torch.where(done, at_end + 1, lengths[at])
                        eos_hit[at] = eos_hit[at] | by_eos
            else:
                hit = torch.isin(tok, eos) if eos is not None else None
                if stopped is not None:  # bookkeeping on the device; the host asks every `every` tokens
                    if hit is not None:
                        hit &= ~stopped
                        eos_hit[at] = eos_hit[at] | hit
                        lengths[at] = torch.where(hit, step + 1, lengths[at])
                        stopped |= hit
                    done = stopped if (step + 1) % every == 0 and bool(stopped.any()) else None
                elif hit is not None and bool(hit.any()):
                    eos_hit[at[hit]] = True
                    lengths[at[hit]] = step + 1
                    done = hit
                if done is not None:
                    go, gone = (~done).nonzero().flatten(), done.nonzero().flatten()
            if told is not None and gone is not None:
                told[at[gone]] = True
                finished(at[gone], tokens, lengths)
            if step == steps - 1:
                break
            if holes:  # every row feeds a column: a masked hole (pad) for one that stopped writing
                feed = torch.full((rows,), pad, dtype=torch.long, device=device)
                feed[sampling] = tok
                if gone is not None:
                    if go.numel() == 0:
                        break
                    writing[sampling[gone]] = False
                    sampling = sampling[go]
                feed.masked_fill_(~writing, pad)
                mask[:, width + step].masked_fill_(~writing, 0)
                tok = feed
            elif gone is not None:
                if go.numel() == 0:
                    break
                if parks:
                    parked.append(cache.park(gone))
                    parked_rows.append(live[gone])
                cache.batch_select_indices(go)
                live, tok, next_pos, mask = live[go], tok[go], next_pos[go], mask[go]
                stopped = stopped[go] if stopped is not None else None
                compacted = True
            step_mask = mask[..., : width + step + 1]
            if self.between_tokens is not None and self.between_tokens(step) and fast is not None:
                fast = self._fast_step(max_positions, rows)  # the decode layout of the new weights
            if fast is not None:
                logits = fast(tok, next_pos, step_mask, cache)
            else:
                logits = self._forward(tok.unsqueeze(-1), step_mask, next_pos.unsqueeze(-1), cache)
            next_pos = next_pos + (writing.long() if holes else 1)

        if told is not None and not bool(told.all()):  # the rows that ran to the limit (or ended unchecked)
            finished((~told).nonzero().flatten(), tokens, lengths)
        if keep:
            if parked:  # every row back in its place
                where = torch.empty(rows, dtype=torch.long, device=device)
                where[torch.cat([live, *parked_rows])] = torch.arange(rows, device=device)
                cache.unpark(parked, where)
            fed = lengths - 1  # the last token is the caller's to feed
            longest = int(fed.max())
            written = torch.arange(longest, device=device) < fed.unsqueeze(1)
            if parks and every > 1:  # rows were computed past their ends, the batch past the last one
                cache.trim(width + longest, width, ~written)
            state.mask = torch.cat([state.mask, written], 1)
            state.next_pos = state.next_pos + fed
        return Decoded(tokens=tokens, logprobs=logprobs, lengths=lengths, eos=eos_hit)

    def _fast_step(self, max_positions: int, rows: int) -> LlamaStyleDecodeStep | None:
        """The lean decode step, prepared for positions below `max_positions` and `rows` rows, where the model
        qualifies."""
        if self.fast_decode_reason:
            return None
        if self._decode_step is None:
            self._decode_step = LlamaStyleDecodeStep(self.model, self.cpu_matmul)
        param = next(self.model.parameters())
        self._decode_step.prepare(max_positions, param.device, param.dtype, rows)
        return self._decode_step

    def _decode_mask(self, real: torch.Tensor, fast: bool, holes: bool) -> torch.Tensor:
        """The attention mask for the whole decode ([B, C] real columns), built once and sliced per step in
        the form the attention takes as is."""
        dtype = next(self.model.parameters()).dtype
        if fast:  # additive, as sdpa would turn a boolean mask into in every layer of every step
            return torch.zeros(real.shape, dtype=dtype, device=real.device).masked_fill_(
                ~real, float("-inf"))[:, None, None, :]
        if self._mask_kind == "sdpa" and not holes:
            return real[:, None, None, :]
        if self._mask_kind == "eager" and not holes:
            zero = torch.zeros((), dtype=dtype, device=real.device)
            return torch.where(real, zero, torch.finfo(dtype).min)[:, None, None, :]
        return real.long()

    # -- the sampler -----------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        images: Sequence[RowImages | None] | None = None,
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt; tensors come back on the model's device. `noise`
        [max_new_tokens, rows] (rows: each prompt n times, in turn) fixes each row's uniform number for each step,
        so that what a row samples does not depend on which other rows share its batch. `images`: each prompt's
        (`verl.models.vision_inputs.RowImages` or None), for a vision-language model."""
        self.check_inputs(input_ids, attention_mask, params)
        if has_images(images) and self.banned_ids is None:
            raise ModelError(f"generate: prompts with images, but {type(self.model).__name__} is not a "
                             "vision-language model; sample them from one (Qwen2-VL, Qwen2.5-VL)")
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                # Prefill each prompt once; the cache is repeated for the n samples afterwards.
                state = self.prefill(input_ids, attention_mask, input_ids.shape[1] + params.max_new_tokens, images)
                state.repeat(params.n)
                out = self.decode(state, params, params.max_new_tokens, generator, finished=self.on_rows_finished,
                                  noise=None if noise is None else noise.to(state.logits.device))
        finally:
            self.model.train(was_training)
        prompt_ids = input_ids.to(device=out.tokens.device, dtype=torch.long).repeat_interleave(params.n, dim=0)
        prompt_mask = attention_mask.to(device=out.tokens.device).repeat_interleave(params.n, dim=0)
        steps = torch.arange(params.max_new_tokens, device=out.tokens.device)
        return RolloutOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=out.tokens,
            response_mask=(steps < out.lengths.unsqueeze(-1)).to(prompt_mask.dtype),
            logprobs=out.logprobs,
            finished=out.eos,
        )


__all__ = ["Decoded", "Decoding", "HFKVCacheEngine", "RowsFinished"]
