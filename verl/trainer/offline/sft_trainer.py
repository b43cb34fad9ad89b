"""`SFTTrainer`: supervised fine-tuning, and the sequence helpers SFT and DPO share.

Both trainers (`OfflineTrainer`, in offline.py) learn from a fixed dataset through the same runtime as `RLTrainer`
(config, device, checkpoints, tracking, exact resume): a `ResumableSampler` picks each step's rows, the step's batch is
split into micro-batches whose losses are weighted so that gradient accumulation equals one big batch, and one
clipped optimizer step follows. `train_steps(n)` runs steps without the checkpointing loop, for callers
such as the demo's warm start that only want the updated model.

SFT's loss is the mean negative log-likelihood over the output tokens of the whole step batch (assistant
turns for `messages` rows). With `sft.packing`, short examples share rows; position ids restart at every
example and the attention mask is left to the model, which in transformers 5.x turns restarting
position ids into a block-diagonal mask, so examples never see each other (checked at start-up).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.data.datasets import IGNORE_INDEX, SFTDataset, pad_token_id
from verl.distributed.offload import activations_offloaded
from verl.errors import ConfigError, DataError, ModelError
from verl.trainer.checks.preflight import Given
from verl.trainer.compose.components import Components, compose_offline
from verl.trainer.forward.logprobs import target_logprobs
from verl.trainer.offline.base import OfflineTrainer, Rows
from verl.trainer.offline.vision import ImageEntry, RowPixels, image_tokens, refuse_unsupported
from verl.utils.tokenizer_protocol import Tokenizer


def shifted_targets(labels: Sequence[int]) -> list[int]:
    """Next-token targets: position t learns labels[t + 1]; an example's last position learns nothing.

    Shifting inside each example (not after packing) is what keeps one packed example from being
    trained to predict the first token of the next.
    """
    return list(labels[1:]) + [IGNORE_INDEX]


def check_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]],
                   vocab_size: int) -> list[tuple[list[int], list[int]]]:
    """Caller-tokenised (ids, labels) examples, checked: same lengths, ids in the vocabulary, some loss."""
    out = []
    for i, example in enumerate(examples):
        ids, labels = (list(x) for x in example)
        where = f"train_examples[{i}]"
        if not ids or len(ids) != len(labels):
            raise DataError(f"{where}: {len(ids)} ids but {len(labels)} labels; give one label per id "
                            f"({IGNORE_INDEX} where there is no loss)")
        if any(not 0 <= t < vocab_size for t in ids):
            raise DataError(f"{where}: token ids must be in [0, {vocab_size}) (the tokenizer's vocabulary)")
        if any(lab != IGNORE_INDEX and lab != t for lab, t in zip(labels, ids, strict=True)):
            raise DataError(f"{where}: a label must be its id or {IGNORE_INDEX}; the shift to next-token "
                            "targets happens inside the trainer")
        if all(lab == IGNORE_INDEX for lab in labels[1:]):
            raise DataError(f"{where}: no token after the first has a label, so the example has no loss")
        out.append((ids, labels))
    if not out:
        raise DataError("train_examples is empty; pass at least one (ids, labels) pair")
    return out


def pack_examples(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Example indices grouped into rows of at most `capacity` tokens (first-fit, longest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def collate_sequences(
    segments: Sequence[Sequence[tuple[list[int], list[int]]]], pad_id: int, packed: bool
) -> dict[str, Any]:
    """Rows of (ids, targets) segments -> input_ids, targets, position_ids, attention_mask, keep_last.

    Unpacked rows (one segment each) are left-padded with a 2-D padding mask, so every row's targets
    end at the last column and only the last `keep_last` positions need logits (`logits_to_keep`):
    the prompt positions never go through the vocabulary projection. Packed rows are right-padded,
    with position ids restarting at every segment and no mask, the layout transformers reads as
    packed sequences; the padding tail is its own segment with ignored targets.
    """
    width = max(sum(len(ids) for ids, _ in row) for row in segments)
    n = len(segments)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    targets = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for r, row in enumerate(segments):
        at = 0 if packed else width - sum(len(ids) for ids, _ in row)
        for ids, tgt in row:
            k = len(ids)
            input_ids[r, at : at + k] = torch.tensor(ids, dtype=torch.long)
            targets[r, at : at + k] = torch.tensor(tgt, dtype=torch.long)
            position_ids[r, at : at + k] = torch.arange(k)
            mask[r, at : at + k] = 1
            at += k
        if packed:
            position_ids[r, at:] = torch.arange(width - at)
    if packed:
        return {"input_ids": input_ids, "targets": targets, "position_ids": position_ids,
                "attention_mask": None, "keep_last": width}
    has = targets != IGNORE_INDEX
    first = torch.where(has, torch.arange(width), width).min(dim=1).values
    return {"input_ids": input_ids, "targets": targets, "position_ids": position_ids, "attention_mask": mask,
            "keep_last": max(1, width - int(first.min()))}




class SFTTrainer(OfflineTrainer):
    """Supervised fine-tuning on `sft` rows. `SFTTrainer(config).fit()`, or from Python with a loaded model:
    `SFTTrainer(config, model=m, tokenizer=t, train_rows=[{"input": ..., "output": ...}]).train_steps(100)`.
    `train_examples=[(ids, labels), ...]` takes examples tokenised by the caller instead of rows, labels
    `IGNORE_INDEX` (-100) where there is no loss: an episode whose tool observations are read, never learned.
    `parts=rl_trainer.parts` trains the RL trainer's policy on its ranks (`runtime.on_parts`; the demos' warm
    start): on a split placement, on the actor's ranks only, data-parallel over them.

    Steps: `sft.steps` if set, else `sft.epochs` x batches per epoch, else `trainer.total_steps`. A step
    is `sft.batch_size` examples (across data-parallel ranks), in micro-batches of
    `actor.micro_batch_size` rows (packed rows when `sft.packing`); learning rate `sft.lr`, schedule,
    warm-up, weight decay and grad clipping from `actor`.

    With a vision-language policy (`parts.processor`), rows with images train too: the prompt tokenised as the
    processor does (each image's pad tokens expanded, never in the loss), the images decoded when their
    micro-batch is built and passed to the forward (`verl.trainer.offline.vision`).
    """

    kind = "sft"
    data_kind = "sft"

    def __init__(
        self,
        config: RunConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        train_rows: Rows | None = None,
        val_rows: Rows | None = None,
        train_examples: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
        parts: Components | None = None,
    ) -> None:
        super().__init__(config, given=Given(model=model, tokenizer=tokenizer, val_rows=val_rows,
                                             rows=train_examples if train_examples is not None else train_rows),
                         parts=parts)
        s, d = config.sft, config.data
        self.pad_id = pad_token_id(self.tokenizer)
        self.boundary_mismatch: dict[str, int] = {}
        self.train_data = self.val_data = None
        processor = getattr(self.parts, "processor", None)
        self.image_tokens, self.pixels = image_tokens(processor), RowPixels(processor) if processor else None
        if train_examples is not None:
            if train_rows is not None:
                raise ConfigError("SFTTrainer got both train_rows and train_examples; pass one of them")
            items = check_examples(train_examples, len(self.tokenizer))
            val = self.normalize_rows(val_rows, "val_rows") if val_rows is not None else []
        else:
            train, val = self.train_val_rows(train_rows, val_rows)
            self.train_data = SFTDataset(train, self.tokenizer, self.max_length, d.truncation,
                                         d.apply_chat_template, images=self.image_tokens)
            self.warn_boundary_mismatch(self.train_data.stats["boundary_mismatch"], len(train), "train")
            items = self.train_data.items
        if val:
            self.val_data = SFTDataset(val, self.tokenizer, self.max_length, d.truncation, d.apply_chat_template,
                                       images=self.image_tokens)
            self.warn_boundary_mismatch(self.val_data.stats["boundary_mismatch"], len(val), "val")
        self.examples = [(list(ids), shifted_targets(labels)) for ids, labels in items]
        # Each example's images (references and tokens per image; None for text) and its row, for messages.
        self.example_images = self.train_data.images if self.train_data is not None else [None] * len(items)
        self.example_rows = self.train_data.rows if self.train_data is not None else [None] * len(items)
        val_images = self.val_data.images if self.val_data is not None else []
        refuse_unsupported(config, "sft", sum(e is not None for e in [*self.example_images, *val_images]))
        self.sampler = self.build_sampler(len(self.examples), s.batch_size, "sft.batch_size")
        total = s.steps or (self.steps_for_epochs(s.epochs) if s.epochs else config.trainer.total_steps)
        if total != config.trainer.total_steps:
            self.config = config.model_copy(
                update={"trainer": config.trainer.model_copy(update={"total_steps": total})})
        optim = compose_offline(self.parts, self.config, lr=s.lr, total_steps=total)
        self.model, (self.optimizer, self.scheduler) = self.parts.policy, optim.pair()
        if s.packing:
            self.check_packing_isolation()

    # ------------------------------------------------------------------ the SFT step
    def step(self) -> dict[str, float]:
        """One optimizer step on the next `sft.batch_size` examples."""
        start = time.perf_counter()
        cfg = self.config.actor
        indices = self.next_indices()
        items = [self.examples[i] for i in indices]
        micro = self.micro_batches(items, packed=self.config.sft.packing,
                                   images=[self.example_images[i] for i in indices],
                                   rows=[self.example_rows[i] for i in indices])
        local_tokens = sum(int((mb["targets"] != IGNORE_INDEX).sum()) for mb in micro)
        (global_tokens,), _ = self.global_sum([local_tokens])
        # Gradients are averaged over the ranks (the members of a sequence-parallel group each hold a part of
        # their group's gradient), so scale by the rank count to get the global token mean.
        scale = self.dp_size * self.sp_size / max(global_tokens, 1)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        nll_sum = 0.0
        for mb in micro:
            with activations_offloaded(cfg.activation_offload, self.device):
                logprobs, _ = target_logprobs(self.model, mb, self.device, self.chunked_logprobs, self.sp)
            nll = -logprobs.sum()
            (nll * scale).backward()
            nll_sum += float(nll.detach())
        grad_norm = self.clip_and_step(self.model, self.optimizer, cfg.grad_clip, self.scheduler)
        (global_nll,), _ = self.global_sum([nll_sum])  # the logged loss is the global batch's, like the gradient
        seconds = time.perf_counter() - start
        input_tokens = sum(len(ids) for ids, _ in items)
        return {"loss": global_nll / max(global_tokens, 1), "grad_norm": grad_norm,
                "lr": self.scheduler.get_last_lr()[0], "tokens/loss": float(local_tokens),
                "timing/step": seconds, "perf/tokens_per_s": input_tokens * self.dp_size / max(seconds, 1e-9)}

    def micro_batches(self, items: Sequence[tuple[list[int], list[int]]], packed: bool,
                      rows_per_micro: int | None = None, images: Sequence[ImageEntry | None] | None = None,
                      rows: Sequence[dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
        """The step's examples as micro-batches of `actor.micro_batch_size` rows (packed rows if `packed`).
        `images`: each example's (`SFTDataset.images`), decoded here, one micro-batch at a time, into the
        micro-batch's `images` (`rows`: the examples' rows, named in errors)."""
        size = rows_per_micro or self.config.actor.micro_batch_size
        if packed:
            capacity = max(self.max_length, max(len(ids) for ids, _ in items))
            segments = [[items[i] for i in b] for b in pack_examples([len(ids) for ids, _ in items], capacity)]
        else:
            segments = [[it] for it in items]
        out = [collate_sequences(segments[s : s + size], self.pad_id, packed) for s in range(0, len(segments), size)]
        if images is not None and any(e is not None for e in images):
            if packed:
                refuse_unsupported(self.config, "sft", sum(e is not None for e in images))
            rows = rows if rows is not None else [None] * len(images)
            for k, mb in enumerate(out):
                mb["images"] = self.pixels.load_all(images[k * size : (k + 1) * size], rows[k * size : (k + 1) * size])
        return out

    # ------------------------------------------------------------------ evaluation
    def validate(self) -> dict[str, float]:
        """Token-mean loss on the held-out rows (this rank's share, summed over ranks)."""
        if self.val_data is None:
            return {}
        items = [(ids, shifted_targets(labels)) for ids, labels in self.val_data.items]
        images, rows = self.val_data.images, self.val_data.rows
        if self.dp_size > 1:
            items, images, rows = (x[self.dp_rank :: self.dp_size] for x in (items, images, rows))
        nll, count = 0.0, 0
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for mb in self.micro_batches(items, packed=False, rows_per_micro=self.config.actor.micro_batch_size * 2,
                                         images=images, rows=rows):
                logprobs, _ = target_logprobs(self.model, mb, self.device, self.chunked_logprobs, self.sp)
                nll -= float(logprobs.double().sum())
                count += logprobs.numel()
        self.model.train(was_training)
        (nll, count), _ = self.global_sum([nll, count])
        return {"val/loss": nll / max(count, 1)}

    def check_packing_isolation(self) -> None:
        """Fail loudly if this model's attention lets packed examples see each other.

        transformers builds the block-diagonal mask from restarting position ids only for models and
        attention kernels that support it; custom (remote-code) models may silently attend across
        examples, which would train on the wrong context.
        """
        first, second = self.examples[0], self.examples[-1]
        alone = collate_sequences([[second]], self.pad_id, packed=False)
        both = collate_sequences([[first, second]], self.pad_id, packed=True)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            a, _ = target_logprobs(self.model, alone, self.device)
            b, _ = target_logprobs(self.model, both, self.device)
        self.model.train(was_training)
        b = b[-a.numel():] if a.numel() else b[:0]
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        gap = float((a - b).abs().max()) if a.numel() else 0.0
        if gap > tol:
            impl = getattr(self.model.config, "_attn_implementation", None)
            raise ModelError(
                f"sft.packing=true but this model (attn_implementation={impl!r}) lets packed examples attend to "
                f"each other: an example's log-probs change by {gap:.3g} when another example is packed before "
                "it. Set sft.packing=false, or use a transformers model with sdpa/eager/flash_attention_2 "
                "attention that honours restarting position_ids")


__all__ = ["OfflineTrainer", "SFTTrainer", "collate_sequences", "pack_examples", "shifted_targets"]
