"""Scoring sequences with a learned reward model (an `AutoModelForSequenceClassification` checkpoint).

The score is read at the last real token, found from the attention mask. Transformers' own pooling looks for
the last token that differs from ``pad_token_id``, which picks the wrong position when pad == eos and the
response ends with eos (common), so we run the backbone and the score head ourselves.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from verl.errors import ModelError
from verl.utils.positions import position_ids_from_mask


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask 1 in each row (works for left and right padding)."""
    mask = attention_mask.long()
    if bool((mask.sum(-1) == 0).any()):
        row = int((mask.sum(-1) == 0).nonzero()[0, 0])
        raise ModelError(f"reward model input row {row} has an all-zero attention mask (an empty sequence). "
                         "Fix: drop empty samples before scoring.")
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * mask).argmax(-1)


class RewardModelScorer:
    """Scores text or token ids with a one-label sequence-classification model: one float per sequence."""

    def __init__(self, path_or_model: str | os.PathLike | nn.Module, tokenizer: Any = None, *,
                 dtype: torch.dtype | str = torch.float32, device: str | torch.device | None = None,
                 max_length: int | None = None, batch_size: int = 16, trust_remote_code: bool = False) -> None:
        from verl.models.hf_loader import check_remote_code, load_tokenizer, quiet_hf_progress
        from verl.utils.dtype import resolve_dtype

        if isinstance(path_or_model, nn.Module):
            model = path_or_model
            source = type(model).__name__
        else:
            from transformers import AutoModelForSequenceClassification

            from verl.models.tiny import build_from_spec, is_tiny_spec

            source = os.fspath(path_or_model)
            if is_tiny_spec(source):  # `tiny[:...]`, built locally with a one-label score head
                source = build_from_spec(source, key="reward.model_path", reward=True)
            check_remote_code(source, trust_remote_code)
            try:
                with quiet_hf_progress():
                    model = AutoModelForSequenceClassification.from_pretrained(
                        source, dtype=resolve_dtype(dtype, where="reward model dtype"),
                        trust_remote_code=trust_remote_code)
            except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
                raise ModelError(f"could not load reward model {source!r} as a sequence-classification model: "
                                 f"{type(exc).__name__}: {exc}. Fix: point reward.model_path at a directory "
                                 "saved from AutoModelForSequenceClassification (num_labels=1).") from exc
            if tokenizer is None:
                tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code)
        num_labels = getattr(model.config, "num_labels", 1)
        if num_labels != 1:
            raise ModelError(f"reward model {source} has num_labels={num_labels}; a reward model must output one "
                             "score. Fix: use a checkpoint trained with num_labels=1.")
        self.head = getattr(model, "score", None) or getattr(model, "classifier", None)
        prefix = getattr(model, "base_model_prefix", "model")
        self.backbone = getattr(model, prefix, None)
        if not isinstance(self.head, nn.Module) or not isinstance(self.backbone, nn.Module):
            raise ModelError(f"reward model {source} ({type(model).__name__}) has no `score`/`classifier` head "
                             f"or no `{prefix}` backbone. Fix: use a *ForSequenceClassification checkpoint of a "
                             "decoder architecture (Llama, Qwen2, Mistral, ...).")
        if tokenizer is not None and tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ModelError(f"the reward model tokenizer for {source} has neither pad nor eos token. Fix: "
                                 "set tokenizer.pad_token before building RewardModelScorer.")
            tokenizer.pad_token = tokenizer.eos_token
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.source = source
        self.max_length = max_length
        self.batch_size = batch_size
        if device is not None:
            self.model.to(device)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def score_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` (float32) at each row's last non-pad token; any padding side works."""
        if input_ids.shape != attention_mask.shape:
            raise ModelError(f"score_ids: input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must have the same shape.")
        last = last_token_index(attention_mask)
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        picked = hidden[rows, last.to(hidden.device)]
        return self.head(picked).squeeze(-1).float().cpu()

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """Scores ``[len(texts)]`` for full texts (prompt + response, already formatted)."""
        if self.tokenizer is None:
            raise ModelError("score_texts needs a tokenizer: pass one to RewardModelScorer(model, tokenizer).")
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=self.max_length is not None, max_length=self.max_length,
                                   add_special_tokens=False)
            scores.append(self.score_ids(batch["input_ids"], batch["attention_mask"]))
        return torch.cat(scores) if scores else torch.zeros(0)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return self.score_texts(texts)


__all__ = ["RewardModelScorer", "last_token_index"]
