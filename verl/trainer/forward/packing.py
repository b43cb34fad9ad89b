"""Remove-padding forwards (`actor.remove_padding`, `critic.remove_padding`): a micro-batch's sequences run as
one packed row, without their padding.

An RL micro-batch is left-padded prompts and right-padded responses, so its forward runs rows x (longest
prompt + longest response) positions; with long-tailed response lengths most of them are padding. Packed,
every row's attended tokens are concatenated into a single row, each sequence's positions restarting at 0.
Each sequence must then attend only to itself: through verl's per-sequence attention
(`verl.models.varlen_attention`, given the sequences' lengths) where the model hands keywords down to a
Qwen2/Llama-style attention, else through transformers, which reads the boundaries off the position ids when
no mask is given (its packed-sequence mask; flash-attention's varlen path on GPUs). The forward runs exactly
the real tokens, and every attended token sees what it sees in the padded forward, so the log-probs, values
and gradients equal the padded ones up to float rounding. SFT's packed rows (`sft.packing`) take the same path.

A model whose attention does not follow packed position ids (custom code that builds its own causal mask, a
wrapper that drops the sequence lengths) would silently attend across sequences, so each model is probed once
before its first packed forward (`check_packing`): two short sequences run packed, as the forwards run them,
must give what each gives alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from verl.errors import ConfigError
from verl.models.lora import base_of
from verl.models.varlen_attention import KWARG as VARLEN_KWARG
from verl.models.varlen_attention import NATIVE_VARLEN, SUPPORTED_MODEL_TYPES, varlen_ready


@dataclass
class PackedLayout:
    """A micro-batch packed into one row: `ids` and `positions` [1, T] (T attended tokens), `predictors` [N] the
    packed index whose output predicts each attended response token, `attended` [B, R] those tokens."""

    ids: torch.Tensor
    positions: torch.Tensor
    predictors: torch.Tensor
    attended: torch.Tensor

    @classmethod
    def of(cls, mb: Any) -> PackedLayout:
        mask = mb.attention_mask.bool()
        index = (mask.flatten().long().cumsum(0) - 1).view(mask.shape)  # each attended token's packed index
        attended = mb.response_attention.bool()
        # A response token follows at least its prompt's last token, of its own sequence: the one before predicts it.
        predictors = index[:, mask.shape[1] - attended.shape[1]:][attended] - 1
        return cls(mb.input_ids[mask][None], mb.position_ids[mask][None], predictors, attended)

    def labels(self, response_ids: torch.Tensor) -> torch.Tensor:
        """The attended response tokens, [1, N]."""
        return response_ids[self.attended][None]

    def unpacked(self, values: torch.Tensor) -> torch.Tensor:
        """[1, N] per-token values back to the batch's [B, R] (0 where a row has no response token)."""
        return values.new_zeros(self.attended.shape).masked_scatter(self.attended, values[0])


def packed_row_inputs(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """Forward arguments that run rows of packed sequences (`positions` restarting at 0 at each one, [B, W] or
    [1, W]) as one row: with verl's per-sequence attention where the model takes it (`varlen_ready`: no mask
    is built), else for transformers' packed-sequence mask. `check_packing` probes a model with these."""
    ids, flat = ids.reshape(1, -1), positions.expand(ids.shape).reshape(1, -1)
    if not varlen_ready(model):
        return {"input_ids": ids, "position_ids": flat, "attention_mask": None}
    starts = (flat[0] == 0).nonzero().flatten()
    lengths = torch.diff(starts, append=starts.new_tensor([flat.shape[1]])).tolist()
    return {"input_ids": ids, "position_ids": flat, VARLEN_KWARG: lengths,
            "attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=ids.device)}


def describe_remove_padding(config: Any, facts: dict[str, Any]) -> str | None:
    """What `actor.remove_padding` / `critic.remove_padding` will do in an RL run, for `verl check` (`facts`:
    the model's attention, read off its config: `verl.distributed.sequence_parallel.model_facts`)."""
    roles = [r for r in ("actor", "critic")
             if getattr(config, r).remove_padding and (r == "actor" or config.needs_critic)]
    if not roles:
        return None
    attention = config.model.attn_implementation or "sdpa"
    if attention in NATIVE_VARLEN:
        how = f"{attention} attends within each packed sequence itself"
    elif facts.get("model_type") in SUPPORTED_MODEL_TYPES and not facts.get("sliding_window"):
        how = "each packed sequence attends alone (verl's per-sequence attention)"
    else:
        how = "transformers' packed-sequence mask, probed at the first packed forward"
    also = ""
    if "actor" in roles and config.actor.sequence_parallel_size > 1:
        also = "; with sequence parallelism the split forwards pack their rows whatever this setting"
    elif "actor" in roles and config.actor.share_prompt_forward and config.rollout.n > 1:
        also = "; it replaces the actor's shared-prompt forward"
    return (f"{' and '.join(f'{r}.remove_padding' for r in roles)}: micro-batches packed into one row without "
            f"padding; {how}{also}")


_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def check_packing(model: torch.nn.Module, setting: str) -> None:
    """Refuse `model` for packed forwards if its attention does not follow packed position ids (probed once per
    model, on every rank alike: FSDP gathers its weights for the probe's forwards)."""
    if model not in _CHECKED:
        _CHECKED[model] = _packing_problem(model)
    if _CHECKED[model] is not None:
        raise ConfigError(f"{setting}=true, but {_CHECKED[model]}. Fix: set {setting}=false (padded forwards) or "
                          "use a model whose attention masks come from transformers (position ids restarting at 0 "
                          "mark each packed sequence)")


def _packing_problem(model: torch.nn.Module) -> str | None:
    device = next(base_of(model).parameters()).device
    ids = torch.tensor([[1, 2, 3, 4, 5]], device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1]], device=device)

    def run(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        inputs = packed_row_inputs(model, ids, positions) if mask is None else {
            "input_ids": ids, "position_ids": positions, "attention_mask": mask}
        out = model(**inputs, use_cache=False)
        return (out if isinstance(out, torch.Tensor) else out.logits).float()

    training = model.training
    model.eval()  # no dropout in the probe
    try:
        with torch.no_grad():
            packed = run(ids, positions, None)  # as the packed forwards run it
            alone = torch.cat([run(ids[:, :3], positions[:, :3], torch.ones_like(ids[:, :3])),
                               run(ids[:, 3:], positions[:, 3:], torch.ones_like(ids[:, 3:]))], dim=1)
            across = run(ids, positions, torch.ones_like(ids))  # the second sequence attending to the first
    finally:
        model.train(training)
    apart, error = (across - alone).abs().max(), (packed - alone).abs().max()
    if error <= 0.1 * apart or apart == 0:
        return None
    return (f"{type(model).__name__} attends across packed sequences (its outputs differ by {error:.3g} from each "
            f"sequence run alone)")
