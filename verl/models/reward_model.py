"""Reward models: one-label `AutoModelForSequenceClassification` models, scored and built for training.

The score is read at the last real token, found from the attention mask. Transformers' own pooling looks for
the last token that differs from ``pad_token_id``, which picks the wrong position when pad == eos and the
response ends with eos (common), so `sequence_scores` takes the head's per-token output and reads it there
itself. Scoring (`RewardModelScorer`, RL's `reward.model_path`) and training (`trainer.kind: rm`) both go
through `sequence_scores`, so a trained reward model scores in RL exactly as it was trained.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from verl.errors import ModelError
from verl.utils.lora import is_peft_model
from verl.utils.positions import position_ids_from_mask
from verl.utils.tokenizer_protocol import Tokenizer


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask 1 in each row (works for left and right padding)."""
    mask = attention_mask.long()
    if bool((mask.sum(-1) == 0).any()):
        row = int((mask.sum(-1) == 0).nonzero()[0, 0])
        raise ModelError(f"reward model input row {row} has an all-zero attention mask (an empty sequence). "
                         "Fix: drop empty samples before scoring.")
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * mask).argmax(-1)


def score_head(model: nn.Module) -> nn.Module:
    """The `score` (or `classifier`) head of a sequence-classification model, under a peft wrapper too."""
    base = model.get_base_model() if is_peft_model(model) else model
    head = getattr(base, "score", None) or getattr(base, "classifier", None)
    if not isinstance(head, nn.Module):
        raise ModelError(f"{type(base).__name__} has no `score`/`classifier` head. Fix: use a "
                         "*ForSequenceClassification model of a decoder architecture (Llama, Qwen2, Mistral, ...).")
    return head


@contextmanager
def _captured(module: nn.Module, out: dict[str, torch.Tensor]):
    handle = module.register_forward_hook(lambda _m, _i, output: out.__setitem__("output", output))
    try:
        yield
    finally:
        handle.remove()


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One score per row ``[B]`` (differentiable), read at each row's last non-pad token; any padding side.

    The model runs its own forward (so FSDP2's and peft's hooks run as they should), and the head's per-token
    output ``[B, T, 1]`` is taken from there, not transformers' pooled logits (see the module docstring).
    Positions count real tokens only, so left and right padding give the same scores."""
    last = last_token_index(attention_mask)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
              "position_ids": position_ids_from_mask(attention_mask)}
    return scores_at(model, inputs, torch.arange(len(last), device=last.device), last)


def scores_at(model: nn.Module, inputs: dict[str, torch.Tensor], rows: torch.Tensor,
              columns: torch.Tensor) -> torch.Tensor:
    """The head's score at (`rows`[i], `columns`[i]) of one forward of `model` on `inputs` (its keyword arguments:
    ids, a 2-D or prepared 4-D attention mask, positions): [len(rows)], differentiable. `sequence_scores` reads
    each row's last real token; a row may hold several sequences (`verl.trainer.forward.pair_rows`)."""
    captured: dict[str, torch.Tensor] = {}
    with _captured(score_head(model), captured):
        out = model(**inputs, use_cache=False)
    per_token = captured.get("output")
    if per_token is None or per_token.dim() != 3:
        shape = None if per_token is None else tuple(per_token.shape)
        raise ModelError(f"{type(model).__name__}: its score head gave {shape}, not one score per token [B, T, 1]; "
                         "a reward model must be a decoder *ForSequenceClassification model")
    scores = per_token[rows.to(per_token.device), columns.to(per_token.device), 0]
    if scores.requires_grad:
        # FSDP2 gathers the root module's weights (the head among them) for backward from a hook on the tensors the
        # root returns; the scores come from inside the forward, so the returned logits join the graph, adding 0.
        scores = scores + 0.0 * out.logits.sum()
    return scores


def reward_model_from_causal_lm(causal_lm: nn.Module, pad_token_id: int) -> nn.Module:
    """A one-label ``*ForSequenceClassification`` model on `causal_lm`'s own backbone (shared, not copied; the
    LM head is left out) with a zero score head: what `trainer.kind: rm` trains, in the layout
    `AutoModelForSequenceClassification.from_pretrained` loads (``model.*`` and ``score.weight``). The zero
    head makes every first reward 0 (a first loss of exactly log 2) while its gradient, the hidden state, is not.
    """
    from transformers import AutoModelForSequenceClassification

    prefix = getattr(causal_lm, "base_model_prefix", "model")
    backbone = getattr(causal_lm, prefix, None)
    if not isinstance(backbone, nn.Module):
        raise ModelError(f"cannot find the backbone `{prefix}` of {type(causal_lm).__name__} to put a score head on. "
                         "Fix: use a Hugging Face *ForCausalLM model")
    config = copy.deepcopy(causal_lm.config)
    config.num_labels, config.pad_token_id = 1, pad_token_id
    try:
        with torch.device("meta"):  # the classifier's own backbone is replaced below: never allocated
            model = AutoModelForSequenceClassification.from_config(config)
    except ValueError as exc:
        raise ModelError(f"{type(causal_lm).__name__} has no sequence-classification version in transformers "
                         f"({exc}), so it cannot be trained as a reward model") from None
    setattr(model, model.base_model_prefix, backbone)
    head = score_head(model)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ModelError(f"{type(model).__name__}'s head is {type(head).__name__}, not a Linear(hidden, 1) read per "
                         "token; a reward model needs a decoder *ForSequenceClassification architecture")
    weight = next(backbone.parameters())
    fresh = nn.Linear(head.in_features, 1, bias=head.bias is not None, device=weight.device, dtype=weight.dtype)
    nn.init.zeros_(fresh.weight)
    if fresh.bias is not None:
        nn.init.zeros_(fresh.bias)
    model.score = fresh
    model.config.architectures = [type(model).__name__]
    model.train(causal_lm.training)
    return model


class RewardModelScorer:
    """Scores text or token ids with a one-label sequence-classification model: one float per sequence."""

    def __init__(self, path_or_model: str | os.PathLike | nn.Module, tokenizer: Tokenizer | None = None, *,
                 dtype: torch.dtype | str = torch.float32, device: str | torch.device | None = None,
                 max_length: int | None = None, batch_size: int = 16, trust_remote_code: bool = False) -> None:
        from verl.models.hf_loader import check_remote_code, load_tokenizer, quiet_hf_progress, without_hub_kernels
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
                    model, info = AutoModelForSequenceClassification.from_pretrained(
                        source, dtype=resolve_dtype(dtype, where="reward model dtype"),
                        trust_remote_code=trust_remote_code, output_loading_info=True)
            except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
                raise ModelError(f"could not load reward model {source!r} as a sequence-classification model: "
                                 f"{type(exc).__name__}: {exc}. Fix: point reward.model_path at a directory "
                                 "saved from AutoModelForSequenceClassification (num_labels=1).") from exc
            without_hub_kernels(model)
            check_head_loaded(source, model, info)
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
        return sequence_scores(self.model, input_ids.to(self.device), attention_mask.to(self.device)).float().cpu()

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """Scores ``[len(texts)]`` for full texts (prompt + response, already formatted). A text that occurs
        several times (a group's samples often agree) is scored once."""
        if self.tokenizer is None:
            raise ModelError("score_texts needs a tokenizer: pass one to RewardModelScorer(model, tokenizer).")
        unique = list(dict.fromkeys(texts))
        scores = []
        for start in range(0, len(unique), self.batch_size):
            batch = self.tokenizer(unique[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=self.max_length is not None, max_length=self.max_length,
                                   add_special_tokens=False)
            scores.append(self.score_ids(batch["input_ids"], batch["attention_mask"]))
        if not scores:
            return torch.zeros(0)
        of = {text: i for i, text in enumerate(unique)}
        return torch.cat(scores)[torch.tensor([of[t] for t in texts], dtype=torch.long)]

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return self.score_texts(texts)


HEAD_PREFIXES = ("score.", "classifier.")


def no_head_message(source: str, missing: list[str], architectures: list[str] | None) -> str:
    held = "/".join(architectures or ["model without a score head"])
    return (f"reward.model_path={source!r} has no trained score head: its weights lack {', '.join(missing)} (the "
            f"folder holds a {held}), so transformers would start the head at random and every reward would be "
            "noise. Fix: train a reward model (trainer.kind: rm writes <run_dir>/reward_model) or point "
            "reward.model_path at a folder saved from AutoModelForSequenceClassification with num_labels=1")


def check_head_loaded(source: str, model: nn.Module, info: dict[str, Any]) -> None:
    """A folder without trained score weights (a causal LM, a base model) loads with a random head and scores
    noise with no error from transformers: refused here, naming what the folder holds instead."""
    head_keys = {name for name, _ in model.named_parameters() if name.startswith(HEAD_PREFIXES)}
    missing = sorted(head_keys & set(info.get("missing_keys") or ()))
    if missing:
        raise ModelError(no_head_message(source, missing, getattr(model.config, "architectures", None)))


def saved_head_problem(path: str | os.PathLike) -> str | None:
    """The same refusal without loading anything (`verl check`, the start-up checks): a local folder whose
    safetensors hold no `score.*`/`classifier.*` weight. None when there is no head problem or no safetensors
    to tell from (the loader then checks)."""
    import json
    from pathlib import Path

    folder = Path(path)
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                names = list(f.keys())
        else:
            return None
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError):
        return None  # unreadable: the loader reports it with its own words
    if any(n.startswith(HEAD_PREFIXES) for n in names):
        return None
    return no_head_message(os.fspath(path), ["score.weight"], config.get("architectures"))


__all__ = ["RewardModelScorer", "check_head_loaded", "last_token_index", "reward_model_from_causal_lm",
           "saved_head_problem", "score_head", "scores_at", "sequence_scores"]
