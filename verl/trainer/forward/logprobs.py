"""Model forward passes the trainers share: response log-probs (+ entropy) and critic values.

Only the response positions are turned into log-probs, and in float32, so a long prompt costs no
vocabulary-sized memory. The logits stay in the model's dtype: the log-prob functions upcast one row chunk
at a time (forward and backward), so a bf16 model never holds a float32 [B, R, V] copy for its backward.
With `chunked` (actor.chunked_logprobs) the model does not make the [B, R, V] logits at all: its head's input
is taken (`verl.models.head.HeadCapture`) and projected one chunk of tokens at a time, forward and backward
(`verl.algorithms.head_token_logprobs`). SFT and DPO take the same switch for their target tokens
(`labelled_logprobs`). A tensor-parallel head's logits are a DTensor sharded over the vocabulary: their log-probs
and entropy come from the shards (`verl.distributed.tensor_parallel.vocab_parallel_logprobs`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from verl.algorithms import (
    entropy_from_logits,
    head_token_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
)
from verl.data.datasets import IGNORE_INDEX
from verl.distributed.memory_plan import chunks_logits, micro_batch_tokens
from verl.distributed.sequence_parallel import KWARG, SequenceParallel, SplitCall, gather_sequence
from verl.distributed.tensor_parallel import is_tensor_parallel, vocab_parallel_logprobs
from verl.errors import ConfigError
from verl.models.head import HeadCapture, HeadOutput, head_unsupported, output_head
from verl.models.lora import base_of
from verl.models.signature import (
    cache_argument,
    forward_accepts,
    keeps_positions,
    returned_cache,
    takes_cache,
)
from verl.models.vision import is_vision_language, unsampled_token_ids
from verl.models.vision_inputs import RowImages, has_images, image_forward_inputs
from verl.trainer.forward.packing import PackedLayout, check_packing, packed_row_inputs
from verl.utils.positions import position_ids_from_mask


def head_positions(model: torch.nn.Module, total: int, start: int, stop: int,
                    device: torch.device) -> tuple[dict[str, object], slice]:
    """Forward kwargs and a slice of its output that give positions [start, stop) of a `total`-position
    input. The head (and its backward) runs on those positions only where the model takes positions; else
    on the last `total - start` (or all) positions, cut down afterwards."""
    if start == 0 and stop == total:
        return {}, slice(None)
    if 0 <= start < stop and keeps_positions(model):
        return {"logits_to_keep": torch.arange(start, stop, device=device)}, slice(None)
    if forward_accepts(model, "logits_to_keep"):
        return {"logits_to_keep": total - start}, slice(0, stop - start)
    return {}, slice(start, stop)


def _sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards `model` (on the wrapper or on the Hugging Face model under a peft wrapper)."""
    return isinstance(model, FSDPModule) or isinstance(base_of(model), FSDPModule)


def sequence_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep_last: int,
) -> torch.Tensor:
    """Logits predicting the last `keep_last` tokens: [B, keep_last, V], in the model's output dtype."""
    return _sequence_output(model, None, input_ids, attention_mask, position_ids, keep_last)


def _sequence_output(model: torch.nn.Module, capture: HeadCapture | None, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor, position_ids: torch.Tensor, keep_last: int,
                     images: Sequence[RowImages | None] | None = None) -> Any:
    """The logits predicting the last `keep_last` tokens, or with `capture` the head's input there. `images`:
    each row's (a vision-language model): the forward gets their pixels and multimodal positions.

    The last token predicts nothing, so it is left out of the forward (causal attention: no other position's
    output depends on it)."""
    total = input_ids.shape[1] - 1
    head, cut = head_positions(model, total, max(total - keep_last, 0), total, input_ids.device)
    extra = image_forward_inputs(model, input_ids[:, :-1], attention_mask[:, :-1], images)
    positions = extra.pop("position_ids", None)
    out = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, :-1] if positions is None else positions, use_cache=False, **head,
                **extra)
    return sliced(output_of(out, "logits", capture), cut)


def output_of(out: Any, field: str, capture: HeadCapture | None) -> Any:
    """A forward's `field` (logits or values), or with `capture` its head input and projection."""
    return getattr(out, field) if capture is None else capture.take(out)


def sliced(output: Any, index: Any) -> Any:
    """`output[:, index]` of logits/values or of a captured head input's hidden states."""
    if isinstance(output, HeadOutput):
        return HeadOutput(output.hidden[:, index], output.weight, output.bias)
    return output[:, index]


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunked: bool = False,
    images: Sequence[RowImages | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token under `model` (logits / temperature, as sampled), optional entropy.

    `entropy_grad=False` computes the entropy for logging only, without adding it to the autograd graph.
    `chunked` computes both from the head's input in token chunks: the model makes no [B, R, V] logits.
    `images`: each row's prompt images (`verl.models.vision_inputs`).
    """
    with head_capture(model, chunked) as capture:  # open until the log-probs are made (FSDP2 keeps the head gathered)
        output = _sequence_output(model, capture, input_ids, attention_mask, position_ids, response_len, images)
        output = without_unsampled(output, unsampled_token_ids(base_of(model)))
        return _logprobs(output, input_ids[:, -response_len:], temperature, with_entropy, entropy_grad)


def without_unsampled(output: torch.Tensor | HeadOutput, banned: Sequence[int]) -> torch.Tensor | HeadOutput:
    """Logits (or the head's input and projection) with the tokens the sampler never samples
    (`verl.models.vision.unsampled_token_ids`) pushed so low that their probability is exactly 0 in float32
    and below (finite: the entropy's p * log p stays 0), so the log-probs are the sampler's distribution's."""
    if not banned:
        return output
    if isinstance(output, DTensor):
        raise ConfigError("a vision-language policy's log-probs with a tensor-parallel head are not supported; "
                          "set actor.tensor_parallel_size=1")
    dtype = output.weight.dtype if isinstance(output, HeadOutput) else output.dtype
    low = max(torch.finfo(dtype).min / 4, -1e9)
    if isinstance(output, HeadOutput):
        index = torch.tensor(banned, device=output.weight.device)
        bias = output.bias if output.bias is not None else output.weight.new_zeros(output.weight.shape[0])
        return HeadOutput(output.hidden, output.weight, bias.index_fill(0, index, low))
    return output.index_fill(-1, torch.tensor(banned, device=output.device), low)


def head_capture(model: torch.nn.Module, chunked: bool) -> Any:
    """A `HeadCapture` of `model` when `chunked`, else a context that captures nothing (`forward_output`
    then gives the logits)."""
    return HeadCapture(model) if chunked else contextlib.nullcontext()


def forward_output(out: Any, capture: HeadCapture | None) -> torch.Tensor | HeadOutput:
    """A causal LM forward's logits, or with `capture` the head input and projection that replace them."""
    return output_of(out, "logits", capture)


def labelled_logprobs(output: torch.Tensor | HeadOutput,
                      targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of every target token [N], the row of each [N]) from logits [B, L, V] or a captured head
    input [B, L, H] and `targets` [B, L] (`IGNORE_INDEX` where a position has none): only the N target
    positions are upcast (logits) or projected in chunks (head input), never all B x L."""
    has = targets != IGNORE_INDEX
    if isinstance(output, HeadOutput):
        logprobs, _ = head_token_logprobs(output.hidden[has], output.weight, targets[has], bias=output.bias)
    else:
        logprobs = token_logprobs(output[has], targets[has])
    return logprobs, has.nonzero()[:, 0]


def _logprobs(output: torch.Tensor | HeadOutput, labels: torch.Tensor, temperature: float, with_entropy: bool,
              entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    t = temperature if temperature > 0 else 1.0  # scaled chunk by chunk, after the upcast (not a [B, R, V] copy)
    if isinstance(output, (HeadOutput, DTensor)):  # the head's input, or a tensor-parallel head's sharded logits
        logprobs, entropy = (
            head_token_logprobs(output.hidden, output.weight, labels, bias=output.bias, temperature=t,
                                with_entropy=with_entropy) if isinstance(output, HeadOutput)
            else vocab_parallel_logprobs(output, labels, temperature=t, with_entropy=with_entropy))
        return logprobs, entropy if entropy is None or entropy_grad else entropy.detach()
    logits = output.contiguous()  # one copy of a sliced view (if any), which the log-probs and entropy share
    if with_entropy and not entropy_grad:  # entropy for logging: from the log-softmax the log-probs take
        return token_logprobs_and_entropy(logits, labels, temperature=t)
    logprobs = token_logprobs(logits, labels, temperature=t)
    return logprobs, entropy_from_logits(logits, temperature=t) if with_entropy else None


def sequence_parallel_logprobs(
    model: torch.nn.Module,
    mb: Any,
    sp: SequenceParallel,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of `mb` (the same rows on every rank of `sp`), its sequences packed into one row
    without padding and split over the group (`split_logprobs`): [B, R] on every rank, 0 where a row has no
    response token."""
    layout, split = SplitRow.of_batch(mb, sp)
    logprobs, entropy = split_logprobs(model, split, temperature=temperature, with_entropy=with_entropy,
                                       entropy_grad=entropy_grad, chunked=chunked)
    return layout.unpacked(logprobs[None]), None if entropy is None else layout.unpacked(entropy[None])


def sequence_parallel_values(critic: torch.nn.Module, mb: Any, sp: SequenceParallel) -> torch.Tensor:
    """`response_values` of `mb` (the same rows on every rank of `sp`), packed and split as
    `sequence_parallel_logprobs` does: [B, R] on every rank."""
    layout, split = SplitRow.of_batch(mb, sp)
    return layout.unpacked(split.gathered(critic(**split.inputs).float())[None])


@dataclass(frozen=True)
class SplitRow:
    """One rank's share of a row of sequences packed back to back (positions restarting at 0 at each), split
    over a sequence-parallel group (the same row on every rank).

    The row is padded to a multiple of the group size (the padding a sequence of its own) and rank i runs the
    model on every S-th token from the i-th (`inputs`), so the ranks hold as many of the response's positions
    wherever it starts; the attention restores the row's order and attends within each sequence
    (`SplitCall`), so every token gets exactly what the padded, masked forward gives it. `predictors` [N] are
    the row positions whose outputs are wanted (for log-probs: the position before each scored token)."""

    sp: SequenceParallel
    inputs: dict[str, Any]  # this rank's forward keywords
    ids: torch.Tensor  # [1, width]: the padded row
    predictors: torch.Tensor  # [N]
    order: torch.Tensor  # [width]: where the gather puts each token of the row
    chunk: int

    @classmethod
    def of(cls, ids: torch.Tensor, positions: torch.Tensor, predictors: torch.Tensor, sp: SequenceParallel) -> SplitRow:
        length, size = ids.shape[1], sp.size
        width = -(-length // size) * size
        tail = width - length
        starts = (positions[0] == 0).nonzero().flatten().tolist() + [length]
        lengths = tuple(b - a for a, b in zip(starts, starts[1:], strict=False)) + ((tail,) if tail else ())
        ids = torch.nn.functional.pad(ids, (0, tail))
        positions = torch.cat([positions, torch.arange(tail, device=ids.device)[None]], dim=1)
        chunk = width // size
        token = torch.arange(width, device=ids.device)
        order = (token % size) * chunk + token // size  # token t is rank t % S's (t // S)-th
        # A 4-D mask is taken as given (no mask is built); the sequence-parallel attention does not read it.
        placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=ids.device)
        mine = slice(sp.index, width, size)
        inputs = {"input_ids": ids[:, mine], "attention_mask": placeholder, "position_ids": positions[:, mine],
                  "use_cache": False, KWARG: SplitCall(sp, lengths, order, torch.argsort(order))}
        return cls(sp, inputs, ids, predictors, order, chunk)

    @classmethod
    def of_batch(cls, mb: Any, sp: SequenceParallel) -> tuple[PackedLayout, SplitRow]:
        """An RL micro-batch's sequences packed into one row (`PackedLayout`: its predictors are those of the
        attended response tokens) and this rank's share of it."""
        layout = PackedLayout.of(mb)
        return layout, cls.of(layout.ids, layout.positions, layout.predictors, sp)

    def local_predictors(self) -> torch.Tensor:
        """The predictors among this rank's tokens, as indices into them."""
        return self.predictors[self.predictors % self.sp.size == self.sp.index] // self.sp.size

    def token(self, local: torch.Tensor) -> torch.Tensor:
        """The row position of this rank's `local`-th tokens."""
        return local * self.sp.size + self.sp.index

    def gathered(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's [1, chunk] values, gathered: the predictors' [N] on every rank (`gather_sequence`: each
        rank's backward runs through its own positions, so the S copies of a loss count once)."""
        return gather_sequence(values, self.sp)[0, self.order[self.predictors]]


def split_logprobs(model: torch.nn.Module, split: SplitRow, *, temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = True, chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of the token after each of `split`'s predictors [N], on every rank (Ulysses:
    `verl.distributed.sequence_parallel`). The head runs on this rank's predictors only (`chunked`: from its
    input, a chunk of tokens at a time; none here: on one position, for nothing); the per-token log-probs (not
    logits) are gathered, so every rank computes the same loss and each one's backward runs through its own
    tokens."""
    here = split.local_predictors()
    keep = here if here.numel() else here.new_zeros(1)  # none here: the head runs on one position, for nothing
    head = {"logits_to_keep": keep} if keeps_positions(model) else {}
    with head_capture(model, chunked) as capture:  # open until the log-probs are made (FSDP2 keeps the head gathered)
        output = forward_output(model(**split.inputs, **head), capture)
        output = output if head else sliced(output, keep)
        logprobs, entropy = _logprobs(output, split.ids[:, split.token(keep) + 1], temperature, with_entropy,
                                      entropy_grad)

    def spread(values: torch.Tensor) -> torch.Tensor:  # this rank's [1, n] -> the predictors' [N]
        # Without predictors, an empty slice of the one it computed: still in the graph, so that this rank's
        # backward runs through its tokens (the attention's all-to-alls wait for every rank's).
        values = values[0, : here.numel()]
        return split.gathered(values.new_zeros(1, split.chunk).index_put((torch.zeros_like(here), here), values))

    return spread(logprobs), spread(entropy) if entropy is not None else None


_CHUNKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, bool]] = weakref.WeakKeyDictionary()


def use_chunked_logprobs(config: Any, model: torch.nn.Module, tokens: int | None = None) -> bool:
    """Whether `model`'s log-probs are computed without its logits (`actor.chunked_logprobs`): `auto` by the
    memory plan's rule (`chunks_logits`) where the head allows it; `true` refuses a head that does not.
    `tokens`: the positions one micro-batch projects (default the RL actor's, from its micro-batch settings and
    rollout.max_new_tokens; SFT and DPO pass theirs). Decided once per model (every pass over the same tokens
    takes the same arithmetic)."""
    if tokens is None:
        a = config.actor
        _, tokens = micro_batch_tokens(a.micro_batch_size, a.max_tokens_per_micro_batch,
                                       config.data.max_prompt_length, config.rollout.max_new_tokens)
    key = (config.actor.chunked_logprobs, tokens)
    if model not in _CHUNKED or _CHUNKED[model][0] != key:
        _CHUNKED[model] = key, _decide_chunked(config, model, tokens)
    return _CHUNKED[model][1]


def _decide_chunked(config: Any, model: torch.nn.Module, tokens: int) -> bool:
    head = output_head(model)
    weight = getattr(head, "weight", None)
    vocab = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 0
    setting = config.actor.chunked_logprobs
    if not chunks_logits(setting, tokens, vocab) or isinstance(weight, DTensor):
        return False  # (a tensor-parallel head: its logits are sharded over the vocabulary; true is refused)
    why = head_unsupported(model)
    if why is not None and setting is True:
        raise ConfigError(f"actor.chunked_logprobs=true, but {why}, so the log-probs cannot be computed from the "
                          "head's input. Fix: set actor.chunked_logprobs=auto (the plain logits for this model) or "
                          "false")
    return why is None


def can_share_prompt(model: torch.nn.Module) -> bool:
    """Whether the shared-prompt forwards apply to `model`: a causal LM or `ValueModel` that continues from
    a KV cache (under a peft wrapper or `AdapterOff` too), without gradient or activation checkpointing
    (which turn the cache off, or recompute into it, in training), nor split by tensor parallelism (its logits
    are a vocabulary-sharded DTensor, which the shared forward's concatenations do not take yet)."""
    inner = getattr(model, "module", model)
    # fsdp.activation_checkpointing patches each decoder layer's forward (verl.distributed.fsdp): its
    # recomputation in backward would append the prompt's keys/values to the shared cache a second time.
    # Hugging Face's flag sits on each checkpointed layer (an AdapterOff reference holds its policy outside
    # its module tree: look under base_of).
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True or getattr(m, "_verl_checkpointed", False)
                        for m in base_of(inner).modules())
    # A vision-language model's prompt holds images: their multimodal positions and pixels go with each whole
    # sequence (`response_logprobs`), not yet through a cached prompt.
    return (takes_cache(model) and not checkpointing and not is_tensor_parallel(base_of(inner).parameters())
            and not is_vision_language(base_of(inner)))


def _shared_prompt_output(
    model: torch.nn.Module,
    field: str,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attention: torch.Tensor,
    capture: HeadCapture | None = None,
) -> Any:
    """`model`'s output `field` (logits or values) at the positions that predict the responses, [B, R, ...],
    running each distinct prompt once; with `capture`, the head's input there instead of the logits.

    Rows with identical (left-padded) prompts, such as the n samples of a GRPO group, share one prompt
    forward; its keys/values (with their autograd graph) are indexed out to every row, and the responses
    run on them. The first response token is predicted by the prompt's last position, the others by the
    response positions before them. Positions and the attention mask are those of the whole sequence, so
    the result equals the unshared forward up to float rounding (and so does every gradient).
    """
    # The last response token predicts nothing: it is left out (causal attention: no output used depends on
    # it), unless it is all the second forward would have (a one-token prompt and response).
    drop = 1 if prompt_ids.shape[1] + response_ids.shape[1] > 2 else 0
    mask = torch.cat([prompt_mask, response_attention.to(prompt_mask.dtype)], dim=1)
    positions = position_ids_from_mask(mask)
    mask, positions = mask[:, : mask.shape[1] - drop], positions[:, : mask.shape[1] - drop]
    _, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(inverse), device=inverse.device), "amin")
    keep = (lambda k: {"logits_to_keep": k}) if forward_accepts(model, "logits_to_keep") else (lambda k: {})
    # The prompt's last token goes with the responses, so that every logit used comes out of one
    # projection of whole rows. (A projection of a [G, 1, H] slice takes a different matmul kernel depending
    # on whether the weights require grad, so a frozen reference would differ from an identical policy by
    # float rounding.) Always two forwards: a data-independent count keeps FSDP's all-gathers in step.
    cut = max(prompt_ids.shape[1] - 1, 1)
    out = model(input_ids=prompt_ids[first, :cut], attention_mask=prompt_mask[first, :cut],
                position_ids=positions[first, :cut], use_cache=True, **keep(1))
    cache = returned_cache(out)
    cache.batch_select_indices(inverse)
    tail = torch.cat([prompt_ids[:, cut:], response_ids[:, : response_ids.shape[1] - drop]], dim=1)
    head, used = head_positions(model, tail.shape[1], 0, tail.shape[1] - 1 + drop, tail.device)
    prompt_out = output_of(out, field, capture)
    result = sliced(output_of(model(input_ids=tail, attention_mask=mask, position_ids=positions[:, cut:],
                                   use_cache=True, **{cache_argument(model): cache}, **head), field, capture), used)
    if isinstance(result, HeadOutput):  # the same projection both times: go on with the hidden states
        result, prompt_out, projection = result.hidden, prompt_out.hidden, result
    if prompt_ids.shape[1] == 1:  # one-token prompts: their output came out of the prompt forward
        result = torch.cat([prompt_out[:, -1:][inverse], result], dim=1)
    elif torch.is_grad_enabled() and _sharded(model):
        # The gradient reaches the prompt forward through the cached keys/values only, which bypasses the
        # per-layer outputs that FSDP2 hooks to gather each layer's weights for backward; a zero-weighted
        # term on its output puts those outputs on the backward path (the values do not change). Unsharded,
        # nothing needs it, and it costs a pass over the [B, T, V] logits forward and backward.
        result = result + 0.0 * prompt_out.sum()
    return result if capture is None else HeadOutput(result, projection.weight, projection.bias)


def shared_prompt_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attention: torch.Tensor,
    capture: HeadCapture | None = None,
) -> torch.Tensor | HeadOutput:
    """The logits `sequence_logits` gives for the responses ([B, R, V], the model's dtype), running each
    distinct prompt once (see `_shared_prompt_output`); with `capture`, the head's input there instead."""
    return _shared_prompt_output(model, "logits", prompt_ids, prompt_mask, response_ids, response_attention, capture)


def shared_prompt_values(
    critic: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attention: torch.Tensor,
) -> torch.Tensor:
    """The values `response_values` gives ([B, R], float32), running each distinct prompt once."""
    return _shared_prompt_output(critic, "values", prompt_ids, prompt_mask, response_ids, response_attention).float()


def shared_prompt_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attention: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` with each distinct prompt run once (see `shared_prompt_logits`)."""
    with head_capture(model, chunked) as capture:
        output = _shared_prompt_output(model, "logits", prompt_ids, prompt_mask, response_ids, response_attention,
                                       capture)
        return _logprobs(output, response_ids, temperature, with_entropy, entropy_grad)


def _packed_inputs(model: torch.nn.Module, layout: PackedLayout, setting: str) -> dict[str, Any]:
    """The packed forward's keyword arguments: each sequence's own attention (`verl.models.varlen_attention`)
    where the model takes it, else transformers' packed-sequence mask, probed once (`check_packing`)."""
    check_packing(model, setting)
    return packed_row_inputs(model, layout.ids, layout.positions) | {"use_cache": False}


def packed_logprobs(model: torch.nn.Module, mb: Any, *, temperature: float = 1.0, with_entropy: bool = False,
                    entropy_grad: bool = True, chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of `mb` with its sequences packed into one row, without padding: [B, R], 0 where a
    row has no response token. The head runs only at the positions that predict response tokens."""
    layout = PackedLayout.of(mb)
    inputs = _packed_inputs(model, layout, "actor.remove_padding")  # (before the capture: a probe needs logits)
    head = {"logits_to_keep": layout.predictors} if keeps_positions(model) else {}
    with head_capture(model, chunked) as capture:
        output = forward_output(model(**inputs, **head), capture)
        output = output if head else sliced(output, layout.predictors)
        logprobs, entropy = _logprobs(output, layout.labels(mb.response_ids), temperature, with_entropy,
                                      entropy_grad)
    return layout.unpacked(logprobs), None if entropy is None else layout.unpacked(entropy)


def packed_values(critic: torch.nn.Module, mb: Any) -> torch.Tensor:
    """`response_values` of `mb` with its sequences packed into one row, without padding (0 where a row has no
    response token)."""
    layout = PackedLayout.of(mb)
    values = critic(**_packed_inputs(critic, layout, "critic.remove_padding"))
    return layout.unpacked(values[:, layout.predictors].float())


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_len: int,
    images: Sequence[RowImages | None] | None = None,
) -> torch.Tensor:
    """V(s_t) for each response token t: the value at the position that predicts it (`images`: each row's, as in
    `response_logprobs`)."""
    extra = image_forward_inputs(critic, input_ids[:, :-1], attention_mask[:, :-1], images)
    positions = extra.pop("position_ids", None)
    values = critic(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                    position_ids=position_ids[:, :-1] if positions is None else positions,
                    **extra)  # the last token predicts nothing
    return values[:, -response_len:].float()


def logprobs_of(model: torch.nn.Module, mb: Any, *, share: bool, temperature: float, with_entropy: bool = False,
                entropy_grad: bool = True, chunked: bool = False, sp: SequenceParallel | None = None,
                packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a batch's response tokens under `model`; with `sp` (a group of more than one
    rank), each sequence split over it (`sequence_parallel_logprobs`: the head runs on the rank's slice only);
    with `packed`, the sequences as one row without padding
    (`packed_logprobs`); with `share`, each group's prompt runs once (`shared_prompt_logprobs`), else every
    sequence whole; `chunked` without [B, R, V] logits."""
    if sp is not None and sp.size > 1:
        return sequence_parallel_logprobs(model, mb, sp, temperature=temperature, with_entropy=with_entropy,
                                          entropy_grad=entropy_grad, chunked=chunked)
    kwargs = dict(temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad, chunked=chunked)
    if packed:
        return packed_logprobs(model, mb, **kwargs)
    if share:
        return shared_prompt_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_attention,
                                      **kwargs)
    return response_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_ids.shape[1],
                             images=getattr(mb, "images", None), **kwargs)


def values_of(critic: torch.nn.Module, mb: Any, *, share: bool, packed: bool = False,
              sp: SequenceParallel | None = None) -> torch.Tensor:
    """V(s_t) of a batch's response tokens under the critic, split over `sp`, packed or sharing prompts as
    `logprobs_of` does."""
    if sp is not None and sp.size > 1:
        return sequence_parallel_values(critic, mb, sp)
    if packed:
        return packed_values(critic, mb)
    if share:
        return shared_prompt_values(critic, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_attention)
    return response_values(critic, mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_ids.shape[1],
                           images=getattr(mb, "images", None))


def target_logprobs(model: torch.nn.Module, batch: Mapping[str, Any], device: torch.device,
                    chunked: bool = False, sp: SequenceParallel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of every target token [N], row index of each [N]) for the positions that have a target.

    Only the N target positions are turned into float32 log-probs, never the whole [B, L, V] logits,
    and with `logits_to_keep` the model projects only the last `keep_last` positions onto the vocabulary.
    `chunked` (actor.chunked_logprobs) makes no [B, L, V] logits at all: the N targets' hidden states are
    projected a chunk of tokens at a time, forward and backward (`labelled_logprobs`).
    `sp` (the same rows on every rank of a sequence-parallel group) packs the rows' tokens into one row without
    padding and splits it over the group (`split_logprobs`). `batch["images"]` (each row's `RowImages` or None,
    for a vision-language model) adds the rows' pixels and multimodal positions (`image_forward_inputs`).
    """
    mask = batch["attention_mask"]
    images = batch.get("images")
    if has_images(images) and (mask is None or (sp is not None and sp.size > 1)):
        raise ConfigError("rows with images cannot run packed or split over sequence-parallel ranks yet. Fix: set "
                          "sft.packing=false and actor.sequence_parallel_size=1")
    if sp is not None and sp.size > 1:  # the rows' tokens (packed rows' too) as one row, split over the group
        keep = torch.ones_like(batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool()
        targets = batch["targets"][keep].to(device)
        has = targets != IGNORE_INDEX  # the target of a position is the token after it
        split = SplitRow.of(batch["input_ids"][keep][None].to(device), batch["position_ids"][keep][None].to(device),
                            has.nonzero()[:, 0], sp)
        logprobs, _ = split_logprobs(model, split, chunked=chunked)
        return logprobs, keep.nonzero()[:, 0].to(device)[has]
    kwargs = {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device),
              "attention_mask": None if mask is None else mask.to(device), "use_cache": False}
    kwargs |= image_forward_inputs(model, kwargs["input_ids"], kwargs["attention_mask"], images)  # {} for text
    rows, width = batch["input_ids"].shape
    keep = batch.get("keep_last", width)
    if keep < width and forward_accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = keep
    packed = mask is None
    if packed:  # packed rows as one row of segments, each attending alone (verl.trainer.forward.packing)
        kwargs |= packed_row_inputs(model, kwargs["input_ids"], kwargs["position_ids"])
    with head_capture(model, chunked) as capture:
        output = forward_output(model(**kwargs), capture)
        if packed:  # the one row back to the batch's rows
            output = (HeadOutput(output.hidden.view(rows, width, -1), output.weight, output.bias)
                      if isinstance(output, HeadOutput) else output.view(rows, width, -1))
        kept = (output.hidden if isinstance(output, HeadOutput) else output).shape[1]
        return labelled_logprobs(output, batch["targets"][:, width - kept :].to(device))
