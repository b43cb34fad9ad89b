"""Pair rows: a preference pair's prompt, chosen and rejected answers in one row of one forward.

DPO's shared-prompt forward (`shared_prompt_logits`) runs each prompt once, then both answers on its cached
keys/values: two forwards, and the answers padded to the longer of all chosen and rejected ones; a reward model
scored each whole sequence, its prompt twice. A pair row lays out [prompt | chosen | rejected] with a mask under
which each answer attends to the prompt and to itself (causally), never to the other answer, and gives the
rejected answer the positions the chosen one has. One forward, the prompt once, each side padded only to its own
longest, and one pass of per-layer overhead. Log-probs (DPO, `pair_row_logps`) and scores (a reward model,
`pair_scores`) equal the whole sequences' up to float rounding, and so do the gradients.

It needs an attention that takes a prepared boolean 4-D mask as it is (Hugging Face's `sdpa`: the mask has no
dtype to agree with a mixed-precision forward) and layers that all attend to the whole past (`takes_masks`);
the mask is [pairs, W, W], so very long rows run whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl.data.datasets import left_pad, right_pad
from verl.distributed.tensor_parallel import is_tensor_parallel
from verl.models.lora import base_of
from verl.models.reward_model import scores_at
from verl.models.signature import full_attention_only, prompt_learning
from verl.models.vision import is_vision_language
from verl.trainer.forward.logprobs import head_positions, labelled_logprobs, output_of, sliced
from verl.utils.positions import position_ids_from_mask

# Masks beyond this many entries ([pairs, W, W] booleans: 64 MiB) cost more memory than the padding they save.
MAX_MASK_ENTRIES = 64 * 2**20


def _widths(layout: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """The prompt's, the longest chosen answer's and the longest rejected answer's widths."""
    half = layout["prompt_ids"].shape[0] // 2
    lengths = layout["response_mask"].sum(1)
    return layout["prompt_ids"].shape[1], int(lengths[:half].max()), int(lengths[half:].max())


def takes_masks(model: torch.nn.Module) -> bool:
    """Whether `model` can run pair rows: its attention is `sdpa` (which takes a prepared boolean 4-D mask as given:
    no dtype to agree with a mixed-precision forward), every layer attends to the whole past, no peft
    prompt-learning wrapper adds tokens to the mask, its weights are not split by tensor parallelism, and it reads
    no images. (Unlike the cached forward, gradient checkpointing is fine: one forward recomputes as it ran.)
    It depends on the model alone, so every rank answers alike."""
    inner = getattr(model, "module", model)
    base = base_of(inner)
    config = getattr(base, "config", None)
    return (getattr(config, "_attn_implementation", None) == "sdpa" and full_attention_only(config)
            and not prompt_learning(inner) and not is_vision_language(base)
            and not is_tensor_parallel(base.parameters()))


def pair_rows_fit(layout: Mapping[str, torch.Tensor]) -> bool:
    """Whether the pairs of `layout` (a `shared_pair_layout`) go in pair rows: each pair's chosen and rejected rows
    share their prompt (a pair whose answers differ from the first token has one-token prompts of its own), and
    the mask is small enough. Where they do not, the caller runs the whole sequences: one forward as well, so that
    ranks whose batches differ here still run the same forwards (FSDP gathers the weights per forward)."""
    half = layout["prompt_ids"].shape[0] // 2
    width = sum(_widths(layout)) - 1
    return (half * width * width <= MAX_MASK_ENTRIES
            and all(torch.equal(layout[k][:half], layout[k][half:]) for k in ("prompt_ids", "prompt_mask")))


def pair_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, chosen_ids: torch.Tensor,
                chosen_mask: torch.Tensor, rejected_ids: torch.Tensor, rejected_mask: torch.Tensor,
                drop_last: bool = False) -> dict[str, Any]:
    """A forward's inputs for pair rows [prompt | chosen | rejected]: the prompts left-padded [m, P], each side's
    answers right-padded to their own longest ([m, C], [m, R]). `drop_last` leaves out the last column (a
    log-prob forward: it predicts nothing)."""
    ids = torch.cat([prompt_ids, chosen_ids, rejected_ids], dim=1)
    real = torch.cat([prompt_mask, chosen_mask, rejected_mask], dim=1).bool()
    prompt_positions = position_ids_from_mask(prompt_mask)
    chosen_w, rejected_w = chosen_ids.shape[1], rejected_ids.shape[1]
    steps = prompt_positions[:, -1:] + 1 + torch.arange(max(chosen_w, rejected_w), device=ids.device)
    positions = torch.cat([prompt_positions, steps[:, :chosen_w], steps[:, :rejected_w]], dim=1)  # both continue
    width = ids.shape[1] - int(drop_last)
    segment = torch.zeros(width, dtype=torch.long, device=ids.device)  # 0: prompt, 1: chosen, 2: rejected
    segment[prompt_ids.shape[1]:] = 1
    segment[prompt_ids.shape[1] + chosen_w:] = 2
    column = torch.arange(width, device=ids.device)
    # query q sees key k: k is real, not after q, and in the prompt or q's own answer; every query sees
    # itself, so that a padding position's softmax has a key (its output is never used)
    allowed = (column[None, :] <= column[:, None]) & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
    allowed = (allowed[None] & real[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=ids.device)[None]
    return {"input_ids": ids[:, :width], "attention_mask": allowed[:, None], "position_ids": positions[:, :width]}


def pair_row_logps(model: torch.nn.Module, layout: Mapping[str, torch.Tensor], capture: Any = None) -> torch.Tensor:
    """Per-row sums of target log-probs [2m] (chosen rows first) of a `shared_pair_layout`, in one forward of
    pair rows (see the module's docstring); with `capture` (a `HeadCapture`) from the head's input in chunks."""
    prompt_w, chosen_w, rejected_w = _widths(layout)
    half, targets = layout["targets"].shape[0] // 2, layout["targets"]
    answers, answer_mask = layout["response_ids"], layout["response_mask"]
    inputs = pair_inputs(layout["prompt_ids"][:half], layout["prompt_mask"][:half], answers[:half, :chosen_w],
                         answer_mask[:half, :chosen_w], answers[half:, :rejected_w], answer_mask[half:, :rejected_w],
                         drop_last=True)
    device, width = inputs["input_ids"].device, inputs["input_ids"].shape[1]
    # the head runs from the prompt's last column, which predicts both answers' first tokens, on: output column
    # c is input column prompt_w - 1 + c; chosen token j is predicted at c = j, rejected token j at c = 0 (j = 0)
    # or chosen_w + j (past the chosen answer)
    head, used = head_positions(model, width, prompt_w - 1, width, device)
    output = sliced(output_of(model(**inputs, use_cache=False, **head), "logits", capture), used)
    rejected_at = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                             torch.arange(chosen_w + 1, chosen_w + rejected_w, device=device)])
    chosen_lp, chosen_rows = labelled_logprobs(sliced(output, slice(0, chosen_w)), targets[:half, :chosen_w])
    rejected_lp, rejected_rows = labelled_logprobs(sliced(output, rejected_at), targets[half:, :rejected_w])
    logprobs, rows = torch.cat([chosen_lp, rejected_lp]), torch.cat([chosen_rows, rejected_rows + half])
    return torch.zeros(2 * half, dtype=logprobs.dtype, device=device).index_add(0, rows, logprobs)


def pair_scores(model: torch.nn.Module, chosen: Sequence[Sequence[int]], rejected: Sequence[Sequence[int]],
                pad_id: int, device: torch.device) -> torch.Tensor | None:
    """A reward model's scores [m, 2] (chosen, rejected) of whole sequences, each pair in one row: the tokens both
    share once, then each answer (see the module's docstring), the score read at each answer's last token. None
    where pair rows do not apply (`takes_masks`, a pair that differs from its first token, too large a mask): score
    them whole, in one forward too."""
    cuts = [next((i for i, (x, y) in enumerate(zip(c, r, strict=False)) if x != y), min(len(c), len(r)))
            for c, r in zip(chosen, rejected, strict=True)]
    cuts = [min(cut, len(c) - 1, len(r) - 1) for cut, c, r in zip(cuts, chosen, rejected, strict=True)]
    if min(cuts) < 1:
        return None
    prompt_ids, prompt_mask = left_pad([list(c[:cut]) for c, cut in zip(chosen, cuts, strict=True)], pad_id)
    chosen_ids, chosen_mask = right_pad([list(c[cut:]) for c, cut in zip(chosen, cuts, strict=True)], pad_id)
    rejected_ids, rejected_mask = right_pad([list(r[cut:]) for r, cut in zip(rejected, cuts, strict=True)], pad_id)
    width = prompt_ids.shape[1] + chosen_ids.shape[1] + rejected_ids.shape[1]
    if not takes_masks(model) or len(cuts) * width * width > MAX_MASK_ENTRIES:
        return None
    inputs = pair_inputs(*(t.to(device) for t in (prompt_ids, prompt_mask, chosen_ids, chosen_mask, rejected_ids,
                                                  rejected_mask)))
    prompt_w, chosen_w = prompt_ids.shape[1], chosen_ids.shape[1]
    last = torch.stack([prompt_w + chosen_mask.sum(1) - 1, prompt_w + chosen_w + rejected_mask.sum(1) - 1], dim=1)
    rows = torch.arange(len(cuts)).repeat_interleave(2)
    return scores_at(model, inputs, rows, last.flatten()).view(-1, 2)


__all__ = ["MAX_MASK_ENTRIES", "pair_inputs", "pair_row_logps", "pair_rows_fit", "pair_scores", "takes_masks"]
