"""DPO's pair rows: a pair's prompt, chosen and rejected answers in one row of one forward.

The shared-prompt forward (`shared_prompt_logits`) runs each prompt once, then both answers on its cached
keys/values: two forwards, and the answers padded to the longer of all chosen and rejected ones. A pair row
lays out [prompt | chosen | rejected] with a mask under which each answer attends to the prompt and to
itself (causally), never to the other answer, and gives the rejected answer the positions the chosen one
has. One forward, each side padded only to its own longest: fewer tokens than the cached forward whenever
chosen and rejected lengths differ, and one pass of per-layer overhead instead of two. The logits equal the
whole-sequence forward's up to float rounding, and so do the gradients.

It needs an attention that takes a prepared boolean 4-D mask as it is (Hugging Face's `sdpa`: the mask has no
dtype to agree with a mixed-precision forward) and layers that all attend to the whole past; the mask is
[pairs, W, W], so very long rows keep the cached forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl.models.lora import base_of
from verl.models.signature import full_attention_only
from verl.trainer.forward.logprobs import can_share_prompt, head_positions, labelled_logprobs, output_of, sliced
from verl.utils.positions import position_ids_from_mask

# Masks beyond this many entries ([pairs, W, W] booleans: 64 MiB) cost more memory than the padding they save.
MAX_MASK_ENTRIES = 64 * 2**20


def _widths(layout: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """The prompt's, the longest chosen answer's and the longest rejected answer's widths."""
    half = layout["prompt_ids"].shape[0] // 2
    lengths = layout["response_mask"].sum(1)
    return layout["prompt_ids"].shape[1], int(lengths[:half].max()), int(lengths[half:].max())


def takes_pair_rows(model: torch.nn.Module, layout: Mapping[str, torch.Tensor]) -> bool:
    """Whether `model` can run `layout` (a `shared_pair_layout`) as pair rows: each pair's chosen and rejected
    rows share their prompt (a pair whose answers differ from the first token has one-token prompts of its
    own), the shared-prompt forward applies, the attention is `sdpa`, every layer attends to the whole past, and
    the mask is small enough."""
    config = getattr(base_of(getattr(model, "module", model)), "config", None)
    half = layout["prompt_ids"].shape[0] // 2
    width = sum(_widths(layout)) - 1
    return (getattr(config, "_attn_implementation", None) == "sdpa" and full_attention_only(config)
            and half * width * width <= MAX_MASK_ENTRIES and can_share_prompt(model)
            and all(torch.equal(layout[k][:half], layout[k][half:]) for k in ("prompt_ids", "prompt_mask")))


def _pair_inputs(layout: Mapping[str, torch.Tensor], chosen_w: int, rejected_w: int) -> dict[str, Any]:
    """The forward's inputs for the pair rows of `layout` (chosen rows, then rejected rows, each prompt twice):
    [prompt | chosen | rejected] without the last column, which predicts nothing."""
    half = layout["prompt_ids"].shape[0] // 2
    prompt_ids, prompt_mask = layout["prompt_ids"][:half], layout["prompt_mask"][:half]
    response_ids, response_mask = layout["response_ids"], layout["response_mask"]
    ids = torch.cat([prompt_ids, response_ids[:half, :chosen_w], response_ids[half:, :rejected_w]], dim=1)
    real = torch.cat([prompt_mask, response_mask[:half, :chosen_w], response_mask[half:, :rejected_w]], dim=1).bool()
    prompt_positions = position_ids_from_mask(prompt_mask)
    steps = prompt_positions[:, -1:] + 1 + torch.arange(max(chosen_w, rejected_w), device=ids.device)
    positions = torch.cat([prompt_positions, steps[:, :chosen_w], steps[:, :rejected_w]], dim=1)  # both continue
    width = ids.shape[1] - 1
    prompt_w = prompt_ids.shape[1]
    segment = torch.zeros(width, dtype=torch.long, device=ids.device)  # 0: prompt, 1: chosen, 2: rejected
    segment[prompt_w:] = 1
    segment[prompt_w + chosen_w:] = 2
    column = torch.arange(width, device=ids.device)
    # query q sees key k: k is real, not after q, and in the prompt or q's own answer; every query sees
    # itself, so that a padding position's softmax has a key (its output is never used)
    allowed = (column[None, :] <= column[:, None]) & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
    allowed = (allowed[None] & real[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=ids.device)[None]
    return {"input_ids": ids[:, :width], "attention_mask": allowed[:, None], "position_ids": positions[:, :width],
            "use_cache": False}


def pair_row_logps(model: torch.nn.Module, layout: Mapping[str, torch.Tensor], capture: Any = None) -> torch.Tensor:
    """Per-row sums of target log-probs [2m] (chosen rows first) of a `shared_pair_layout`, in one forward of
    pair rows (see the module's docstring); with `capture` (a `HeadCapture`) from the head's input in chunks."""
    prompt_w, chosen_w, rejected_w = _widths(layout)
    inputs = _pair_inputs(layout, chosen_w, rejected_w)
    device, width = inputs["input_ids"].device, inputs["input_ids"].shape[1]
    # the head runs from the prompt's last column, which predicts both answers' first tokens, on: output column
    # c is input column prompt_w - 1 + c; chosen token j is predicted at c = j, rejected token j at c = 0 (j = 0)
    # or chosen_w + j (past the chosen answer)
    head, used = head_positions(model, width, prompt_w - 1, width, device)
    output = sliced(output_of(model(**inputs, **head), "logits", capture), used)
    rejected_at = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                             torch.arange(chosen_w + 1, chosen_w + rejected_w, device=device)])
    half, targets = layout["targets"].shape[0] // 2, layout["targets"]
    chosen_lp, chosen_rows = labelled_logprobs(sliced(output, slice(0, chosen_w)), targets[:half, :chosen_w])
    rejected_lp, rejected_rows = labelled_logprobs(sliced(output, rejected_at), targets[half:, :rejected_w])
    logprobs, rows = torch.cat([chosen_lp, rejected_lp]), torch.cat([chosen_rows, rejected_rows + half])
    return torch.zeros(2 * half, dtype=logprobs.dtype, device=device).index_add(0, rows, logprobs)


__all__ = ["MAX_MASK_ENTRIES", "pair_row_logps", "takes_pair_rows"]
