"""Torch datasets and collators for the three kinds.

Rows are tokenised once, up front, so length problems surface before the first step (with the file and
line of the row) instead of in the middle of an epoch, and so `len()` is the number of usable rows.
Prompts are left-padded (generation appends on the right); SFT and preference sequences are
right-padded with labels -100 everywhere except the tokens the loss should learn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from verl.data import image_tokens
from verl.data.chat import encode, encode_conversation, encode_pair, encode_prompt, reward_text, template_mode
from verl.data.image_tokens import ImageTokens
from verl.data.report import location
from verl.errors import ConfigError, DataError, ModelError
from verl.utils.positions import position_ids_from_mask
from verl.utils.tokenizer_protocol import Tokenizer

IGNORE_INDEX = -100
SEQ_TRUNCATION = ("error", "drop", "truncate_left", "truncate_right")


def pad_token_id(tokenizer: Tokenizer) -> int:
    """The pad id, falling back to EOS (the usual choice for decoder-only models without a pad token)."""
    pid = getattr(tokenizer, "pad_token_id", None)
    if pid is None:
        pid = getattr(tokenizer, "eos_token_id", None)
    if pid is None:
        raise ModelError("the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token")
    return int(pid)


def row_location(row: Mapping[str, Any]) -> str:
    """Where a row came from, for an error message: file:line, a Parquet row, a dataset index, or its prompt."""
    if "file" in row and "line" in row and isinstance(row["file"], str) and isinstance(row["line"], int):
        return location(row["file"], row["line"])  # file:line, file.parquet row N, dataset[i]
    if "file" in row or "line" in row:
        return f"{row.get('file', '?')}:{row.get('line', '?')}"
    return f"prompt {str(row.get('prompt'))[:40]!r}"  # a row from an environment or from Python, not a file


def _check(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed; use one of {', '.join(allowed)}")


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both [B, max_len], padded on the left."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both [B, max_len], padded on the right."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
    return ids, mask


class PromptDataset(Dataset):
    """Prompts for RL rollouts; items are {"input_ids": list[int], "row": canonical row}.

    truncation: 'error' raises naming the row, 'drop' leaves the row out (counted in `dropped`),
    'truncate_left' keeps the last max_prompt_length tokens (counted in `truncated`).
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Tokenizer,
        max_prompt_length: int,
        truncation: str = "error",
        apply_chat_template: bool | str = "auto",
    ) -> None:
        _check("truncation", truncation, ("error", "drop", "truncate_left"))
        self.tokenizer = tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.max_prompt_length = max_prompt_length
        mode = template_mode(apply_chat_template)
        self.rows: list[dict[str, Any]] = []
        self.input_ids: list[list[int]] = []
        self.truncated = self.dropped = 0
        for row in rows:
            ids = encode_prompt(tokenizer, row["prompt"], mode, row)
            if len(ids) > max_prompt_length:
                if truncation == "error":
                    raise DataError(
                        f"{row_location(row)}: the prompt has {len(ids)} tokens, more than max_prompt_length="
                        f"{max_prompt_length}; raise data.max_prompt_length or set data.truncation=drop "
                        "or truncate_left"
                    )
                if truncation == "drop":
                    self.dropped += 1
                    continue
                ids = ids[-max_prompt_length:]
                self.truncated += 1
            self.rows.append(row)
            self.input_ids.append(ids)
        if not self.rows:
            raise DataError(
                f"all {self.dropped} prompts are longer than max_prompt_length={max_prompt_length} and were "
                "dropped; raise data.max_prompt_length"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[i], "row": self.rows[i]}

    def collate(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """Left-padded input_ids/attention_mask/position_ids plus the raw rows (for reward functions)."""
        ids, mask = left_pad([b["input_ids"] for b in batch], self.pad_id)
        position_ids = position_ids_from_mask(mask)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": position_ids,
            "rows": [b["row"] for b in batch],
        }


def _truncate(
    ids: list[int], labels: list[int], max_length: int, truncation: str, where: str
) -> tuple[list[int], list[int]] | None:
    if len(ids) <= max_length:
        return ids, labels
    if truncation == "error":
        raise DataError(
            f"{where}: the sequence has {len(ids)} tokens, more than max_length={max_length} (in a config: "
            "data.max_prompt_length + data.max_response_length). Fix: raise the limit, or set data.truncation "
            "to drop or truncate_left"
        )
    if truncation == "drop":
        return None
    if truncation == "truncate_left":
        return ids[-max_length:], labels[-max_length:]
    return ids[:max_length], labels[:max_length]


class SFTDataset(Dataset):
    """Supervised pairs or conversations; items are {"input_ids", "labels"} with -100 outside the output.

    For {"input", "output"} rows the loss covers the output tokens (plus EOS for raw text); for
    {"messages"} rows it covers every assistant turn. `stats` counts truncated, dropped (too long),
    no_loss_tokens (dropped because truncation removed every output token) and boundary_mismatch.
    `images`: a vision-language policy's (`verl.data.image_tokens`); rows with images are refused without it.
    `self.images[i]` is item i's (image references, tokens per image), None for a text row.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Tokenizer,
        max_length: int,
        truncation: str = "error",
        apply_chat_template: bool | str = "auto",
        images: ImageTokens | None = None,
    ) -> None:
        _check("truncation", truncation, SEQ_TRUNCATION)
        self.pad_id = pad_token_id(tokenizer)
        mode = template_mode(apply_chat_template)
        self.rows: list[dict[str, Any]] = []
        self.items: list[tuple[list[int], list[int]]] = []
        self.images: list[tuple[list[Any], list[int]] | None] = []
        self.stats = {"truncated": 0, "dropped": 0, "no_loss_tokens": 0, "boundary_mismatch": 0}
        for row in rows:
            fields = ("messages",) if "messages" in row else ("input", "output")
            tok, text, counts = image_tokens.prepare(row, images, tokenizer, mode, fields)
            if "messages" in row:
                if mode == "never":
                    raise DataError(
                        f"{row_location(row)}: chat messages need apply_chat_template='auto' or 'always'"
                    )
                ids, is_out, mismatch = encode_conversation(tok, text["messages"], row)
                labels = [t if o else IGNORE_INDEX for t, o in zip(ids, is_out, strict=False)]
            else:
                ids, boundary, mismatch = encode_pair(tok, text["input"], text["output"], mode, row)
                labels = [IGNORE_INDEX] * boundary + ids[boundary:]
            if counts:  # each image's pad token -> its tokens (prompt: no label)
                ids, labels = image_tokens.expand(ids, labels, counts, images, row)
            self.stats["boundary_mismatch"] += mismatch
            was = len(ids)
            cut = _truncate(ids, labels, max_length, truncation, row_location(row))
            if cut is None:
                self.stats["dropped"] += 1
                continue
            if counts:
                image_tokens.check_kept(cut[0], counts, images, row, max_length, truncation)
            ids, labels = cut
            self.stats["truncated"] += len(ids) < was
            if all(x == IGNORE_INDEX for x in labels):
                self.stats["no_loss_tokens"] += 1
                continue
            self.rows.append(row)
            self.items.append((ids, labels))
            self.images.append((list(row["images"]), counts) if counts else None)
        if not self.items:
            raise DataError(
                f"no SFT row is usable after tokenisation ({self.stats}); check max_length and the data"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids, labels = self.items[i]
        return {"input_ids": ids, "labels": labels, "row": self.rows[i]}

    def collate(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """Right-padded input_ids/attention_mask, labels padded with -100."""
        ids, mask = right_pad([b["input_ids"] for b in batch], self.pad_id)
        labels, _ = right_pad([b["labels"] for b in batch], IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PreferenceDataset(Dataset):
    """Preference pairs for DPO-style losses.

    Items hold chosen/rejected ids with labels -100 over the prompt. The prompt boundary comes from
    tokenising the prompt alone (templated with a generation prompt if it is messages) and checking it
    is a prefix of prompt+response; rows where it is not are counted in `boundary_mismatch` and their
    boundary is recomputed from character offsets. `images`: as `SFTDataset`'s; an item of a row with images
    has `image_tokens` (tokens per image; chosen and rejected share the prompt's images).
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Tokenizer,
        max_length: int,
        truncation: str = "error",
        apply_chat_template: bool | str = "auto",
        images: ImageTokens | None = None,
    ) -> None:
        _check("truncation", truncation, SEQ_TRUNCATION)
        self.pad_id = pad_token_id(tokenizer)
        mode = template_mode(apply_chat_template)
        self.rows: list[dict[str, Any]] = []
        self.items: list[dict[str, list[int]]] = []
        self.boundary_mismatch = 0
        self.truncated = self.dropped = 0
        for row in rows:
            item: dict[str, list[int]] = {}
            mismatch = False
            keep = True
            cut_any = False
            tok, text, counts = image_tokens.prepare(row, images, tokenizer, mode, ("prompt", "chosen", "rejected"))
            for side in ("chosen", "rejected"):
                ids, boundary, bad = encode_pair(tok, text["prompt"], text[side], mode, row)
                mismatch |= bad
                labels = [IGNORE_INDEX] * boundary + ids[boundary:]
                if counts:  # each image's pad token -> its tokens (prompt: no label)
                    ids, labels = image_tokens.expand(ids, labels, counts, images, row)
                    boundary = next((i for i, t in enumerate(labels) if t != IGNORE_INDEX), len(labels))
                if side == "chosen":
                    item["prompt_input_ids"] = ids[:boundary]
                cut = _truncate(ids, labels, max_length, truncation, row_location(row))
                if cut is not None and counts:
                    image_tokens.check_kept(cut[0], counts, images, row, max_length, truncation)
                if cut is None or all(x == IGNORE_INDEX for x in cut[1]):
                    keep = False
                    break
                cut_any |= len(cut[0]) < len(ids)
                item[f"{side}_input_ids"], item[f"{side}_labels"] = cut
            self.boundary_mismatch += mismatch
            if not keep:
                self.dropped += 1
                continue
            self.truncated += cut_any
            if counts:
                item["image_tokens"] = counts
            self.rows.append(row)
            self.items.append(item)
        if not self.items:
            raise DataError(
                f"no preference row is usable after tokenisation ({self.dropped} dropped); check max_length"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.items[i], "row": self.rows[i]}

    def collate(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """Right-padded chosen_*/rejected_* ids, masks and labels; left-padded prompt ids."""
        out: dict[str, Any] = {}
        for side in ("chosen", "rejected"):
            ids, mask = right_pad([b[f"{side}_input_ids"] for b in batch], self.pad_id)
            labels, _ = right_pad([b[f"{side}_labels"] for b in batch], IGNORE_INDEX)
            out[f"{side}_input_ids"], out[f"{side}_attention_mask"], out[f"{side}_labels"] = ids, mask, labels
        out["prompt_input_ids"], out["prompt_attention_mask"] = left_pad(
            [b["prompt_input_ids"] for b in batch], self.pad_id
        )
        out["rows"] = [b["row"] for b in batch]
        return out


class RewardPairDataset(Dataset):
    """Preference pairs for a reward model: each answer is prompt + answer exactly as RL scores it with
    `reward.model_path` (`chat.reward_text`, tokenised without special tokens), so the model is trained on the
    inputs it will score. Items are {"chosen_input_ids", "rejected_input_ids", "margin"} (margin 0 for rows
    without one).

    truncation: 'error' raises naming the row, 'drop' leaves the pair out (counted in `dropped`),
    'truncate_left' keeps the last `max_length` tokens (the score is read at the last one; `truncated`).
    """

    TRUNCATION = ("error", "drop", "truncate_left")

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer: Tokenizer,
        max_length: int,
        truncation: str = "error",
        apply_chat_template: bool | str = "auto",
    ) -> None:
        _check("truncation", truncation, self.TRUNCATION)
        never = template_mode(apply_chat_template) == "never"
        self.pad_id = pad_token_id(tokenizer)
        self.rows: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []
        self.truncated = self.dropped = 0
        for row in rows:
            if never and any(isinstance(row[k], list) for k in ("prompt", "chosen", "rejected")):
                raise DataError(f"{row_location(row)}: the row has chat messages but data.apply_chat_template=never; "
                                "use auto")
            if image_tokens.has_images(row):
                raise DataError(f"{row_location(row)}: the row has images, but a reward model trains on text pairs "
                                "only (it scores RL's decoded text). Fix: remove the rows' images")
            item: dict[str, Any] = {"margin": float(row.get("margin") or 0.0)}
            for side in ("chosen", "rejected"):
                ids = encode(tokenizer, reward_text(tokenizer, row["prompt"], row[side], row), False)
                cut = _truncate(ids, ids, max_length, truncation, row_location(row))
                if cut is None:
                    break
                self.truncated += len(cut[0]) < len(ids)
                item[f"{side}_input_ids"] = cut[0]
            if "rejected_input_ids" not in item:
                self.dropped += 1
                continue
            if item["chosen_input_ids"] == item["rejected_input_ids"]:
                raise DataError(f"{row_location(row)}: 'chosen' and 'rejected' are the same "
                                f"{len(item['chosen_input_ids'])} "
                                "tokens (after data.truncation=truncate_left kept the last max_length tokens), so "
                                "the pair prefers neither. Fix: raise data.max_prompt_length/max_response_length "
                                "or set data.truncation=drop")
            self.rows.append(row)
            self.items.append(item)
        if not self.items:
            raise DataError(f"no preference pair is usable after tokenisation ({self.dropped} dropped as longer than "
                            f"max_length={max_length}); raise data.max_prompt_length + data.max_response_length")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


__all__ = [
    "PromptDataset",
    "row_location",
    "RewardPairDataset",
    "SFTDataset",
    "PreferenceDataset",
    "IGNORE_INDEX",
    "left_pad",
    "right_pad",
    "pad_token_id",
]
