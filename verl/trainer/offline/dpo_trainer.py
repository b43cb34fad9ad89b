"""`DPOTrainer`: direct preference optimisation (sigmoid / IPO / hinge) on preference pairs.

A step takes `data.train_batch_size` (prompt, chosen, rejected) pairs. Chosen and rejected sequences
of a micro-batch go through the policy together: with `actor.share_prompt_forward`, a pair's prompt
once and both answers in the same row (`verl.trainer.forward.pair_rows`; where the model cannot take that, on
the prompt's cached keys/values), else the whole sequences concatenated; each sequence's log-prob is
the sum over its response tokens (the mean for IPO, whose margin is defined on length-averaged
log-ratios). The reference log-probs come from a frozen copy of the initial policy (with LoRA: the policy with its
adapters off, no copy; or `ref.path`), or,
with `dpo.precompute_ref=true`, from one pass over the data before training, after which the reference
model is freed. The loss formula is `verl.algorithms.dpo_loss`; this file only feeds it.

With a vision-language policy, pairs whose prompt has images train too: chosen and rejected share the prompt's
images (decoded once per micro-batch), which the policy's and the reference's forwards both take; such a
micro-batch runs whole sequences (the shared-prompt forward does not carry images).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl.algorithms import dpo_loss
from verl.config.schema import RunConfig
from verl.data.datasets import IGNORE_INDEX, PreferenceDataset, pad_token_id
from verl.models.lora import is_peft_model
from verl.trainer.checks.preflight import Given
from verl.trainer.compose.components import compose_offline, setup_reference
from verl.trainer.forward.logprobs import (
    can_share_prompt,
    head_capture,
    labelled_logprobs,
    shared_prompt_logits,
    target_logprobs,
)
from verl.trainer.forward.pair_rows import pair_row_logps, pair_rows_fit, takes_masks
from verl.trainer.offline.base import PairTrainer, Rows
from verl.trainer.offline.sft_trainer import collate_sequences, shifted_targets
from verl.trainer.offline.vision import RowPixels, image_tokens, refuse_unsupported
from verl.utils.tokenizer_protocol import Tokenizer

PairItem = Mapping[str, Any]


def shared_pair_layout(items: Sequence[PairItem], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts [2m, P] (left-padded, each pair's prompt twice: chosen rows then rejected rows) and the
    answers [2m, R] (right-padded) with their targets, split where chosen and rejected stop sharing
    tokens and no later than the first labelled token (at least after the first token, which nothing
    predicts; a pair that shares no prefix then has two one-token prompts, run separately)."""
    prompts, answers, targets = [], [], []
    cuts = []
    for it in items:
        c, r = list(it["chosen_input_ids"]), list(it["rejected_input_ids"])
        common = next((i for i, (x, y) in enumerate(zip(c, r, strict=False)) if x != y), min(len(c), len(r)))
        first = [next((i for i, t in enumerate(it[f"{side}_labels"]) if t != IGNORE_INDEX), len(it[f"{side}_labels"]))
                 for side in ("chosen", "rejected")]
        cuts.append(max(1, min(common, *first, len(c) - 1, len(r) - 1)))
    for side in ("chosen", "rejected"):
        for it, cut in zip(items, cuts, strict=True):
            ids, labels = list(it[f"{side}_input_ids"]), list(it[f"{side}_labels"])
            prompts.append(ids[:cut])
            answers.append(ids[cut:])
            targets.append(labels[cut:])
    width_p, width_r = max(map(len, prompts)), max(1, max(map(len, answers)))
    prompt_ids = torch.tensor([[pad_id] * (width_p - len(p)) + p for p in prompts], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    response_ids = torch.tensor([a + [pad_id] * (width_r - len(a)) for a in answers], dtype=torch.long)
    response_mask = torch.tensor([[1] * len(a) + [0] * (width_r - len(a)) for a in answers], dtype=torch.long)
    response_targets = torch.tensor([t + [IGNORE_INDEX] * (width_r - len(t)) for t in targets], dtype=torch.long)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask, "targets": response_targets}


def shared_sequence_logps(model: torch.nn.Module, layout: Mapping[str, torch.Tensor], device: torch.device,
                          chunked: bool = False) -> torch.Tensor | None:
    """Per-row sums of target log-probs [2m] from `shared_pair_layout`, each prompt run once: in pair rows where
    the model takes them (`takes_masks`), else on its cached keys/values where it continues from one
    (`can_share_prompt`); None where neither applies, or where a model that takes pair rows gets pairs that do
    not fit them (`pair_rows_fit`): the caller runs the whole sequences, in one forward like the pair rows.
    `chunked`: from the head's input, see `target_logprobs`."""
    t = {k: v.to(device) for k, v in layout.items()}
    if takes_masks(model):
        if not pair_rows_fit(t):
            return None
        with head_capture(model, chunked) as capture:
            return pair_row_logps(model, t, capture)
    if not can_share_prompt(model):
        return None
    with head_capture(model, chunked) as capture:
        output = shared_prompt_logits(model, t["prompt_ids"], t["prompt_mask"], t["response_ids"],
                                      t["response_mask"], capture)
        logprobs, rows = labelled_logprobs(output, t["targets"])
    return torch.zeros(len(t["targets"]), dtype=logprobs.dtype, device=logprobs.device).index_add(0, rows, logprobs)


class PairBatch:
    """The pairs of one micro-batch, laid out on first use in the form a forward takes: ``collated`` (chosen
    then rejected rows, left-padded to one width: [2m, L]) or ``shared`` (each pair's prompt once, see
    :func:`shared_pair_layout`; None when the shared-prompt forward is off). The policy and reference passes
    use the same object, so each layout is built at most once and the unused one never. Pairs with images
    (`image_tokens` in the item) get their images decoded once, by `pixels`, for the chosen and the rejected
    row (``collated["images"]``); such a batch never shares prompts."""

    def __init__(self, items: Sequence[PairItem], pad_id: int, *, share: bool, pixels: RowPixels | None = None) -> None:
        self.has_images = any("image_tokens" in it for it in items)
        self.items, self.pad_id, self.share, self.pixels = items, pad_id, share and not self.has_images, pixels

    @functools.cached_property
    def collated(self) -> dict[str, Any]:
        seqs = [[(it[f"{side}_input_ids"], shifted_targets(it[f"{side}_labels"]))]
                for side in ("chosen", "rejected") for it in self.items]
        out = collate_sequences(seqs, self.pad_id, packed=False)
        if self.has_images:
            entries = [(it["row"]["images"], it["image_tokens"]) if "image_tokens" in it else None for it in self.items]
            pictures = self.pixels.load_all(entries, [it.get("row") for it in self.items])
            out["images"] = pictures + pictures  # chosen rows, then rejected rows: the same prompt images
        return out

    @functools.cached_property
    def shared(self) -> dict[str, torch.Tensor] | None:
        return shared_pair_layout(self.items, self.pad_id) if self.share else None


class DPOTrainer(PairTrainer):
    """Offline DPO. `DPOTrainer(config).fit()`, or from Python with a loaded model:
    `DPOTrainer(config, model=m, tokenizer=t, train_rows=[{"prompt", "chosen", "rejected"}, ...])`.

    `actor.micro_batch_size` counts sequences per forward, so a micro-batch holds half as many pairs.
    Learning rate `dpo.lr`; schedule, warm-up, weight decay and grad clipping from `actor`.
    """

    kind = "dpo"

    def __init__(
        self,
        config: RunConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        ref_model: torch.nn.Module | None = None,
        train_rows: Rows | None = None,
        val_rows: Rows | None = None,
    ) -> None:
        super().__init__(config, given=Given(model=model, tokenizer=tokenizer, rows=train_rows, val_rows=val_rows))
        p, d = config.dpo, config.data
        self.pad_id = pad_token_id(self.tokenizer)
        processor = getattr(self.parts, "processor", None)
        self.image_tokens, self.pixels = image_tokens(processor), RowPixels(processor) if processor else None
        train, val = self.train_val_rows(train_rows, val_rows)
        self.boundary_mismatch: dict[str, int] = {}
        self.train_data = self._dataset(train, "train")
        self.val_data = self._dataset(val, "val") if val else None
        refuse_unsupported(config, "dpo", sum("image_tokens" in it for data in (self.train_data, self.val_data)
                                              if data is not None for it in data.items))
        self.sampler = self.build_sampler(len(self.train_data), d.train_batch_size, "data.train_batch_size")
        self.pairs_per_micro = max(1, config.actor.micro_batch_size // 2)
        # Precomputed reference log-probs: [rows, 2] (chosen, rejected), sums over response tokens.
        self.ref_logps: dict[str, torch.Tensor] = {}
        if p.precompute_ref:
            # The untrained policy is the reference, so it scores the data itself: no copy is ever made
            # (with LoRA: the policy with its adapters off).
            ref = ref_model if ref_model is not None or config.ref.path else self.model
            self.ref_model = self._load_ref(ref) if ref is not self.model or is_peft_model(ref) else ref
            self.ref_logps["train"] = self.precompute(self.train_data)
            if self.val_data is not None:
                self.ref_logps["val"] = self.precompute(self.val_data)
            self.model.train()
            self.ref_model = None  # freed: training never runs the reference again
        else:
            self.ref_model = self._load_ref(ref_model)
        optim = compose_offline(self.parts, config, lr=p.lr, total_steps=config.trainer.total_steps)
        self.model, (self.optimizer, self.scheduler) = self.parts.policy, optim.pair()

    def _dataset(self, rows: list[dict[str, Any]], split: str) -> PreferenceDataset:
        d = self.config.data
        data = PreferenceDataset(rows, self.tokenizer, self.max_length, d.truncation, d.apply_chat_template,
                                 images=self.image_tokens)
        self.warn_boundary_mismatch(data.boundary_mismatch, len(rows), split)
        return data

    def _load_ref(self, given: torch.nn.Module | None) -> torch.nn.Module:
        """The frozen reference (`components.setup_reference`): `given`, else `ref.path`, else a copy of the
        policy's initial weights (with LoRA: the policy itself with its adapters off)."""
        return setup_reference(self.config, self.model, self.tokenizer, self.parts.process,
                               given=None if given is self.model else given, defer=False)

    # ------------------------------------------------------------------ log-probs
    def pair_batch(self, items: Sequence[PairItem]) -> PairBatch:
        return PairBatch(items, self.pad_id, share=self.config.actor.share_prompt_forward, pixels=self.pixels)

    def sequence_logps(self, model: torch.nn.Module, batch: PairBatch) -> torch.Tensor:
        """Sum of response-token log-probs per sequence: [2m] (chosen first), differentiable.

        With `actor.share_prompt_forward` a pair's prompt runs once, both answers in its row or on its cached
        keys/values (`shared_sequence_logps`: same sums and gradients as the concatenated forward). With
        sequence parallelism every sequence is split over the group instead (`target_logprobs`). A batch with
        images runs whole sequences with their images (`PairBatch.collated`), through the policy and the
        reference alike."""
        chunked = self.chunks_logprobs(model)
        shared = shared_sequence_logps(model, batch.shared, self.device, chunked) if batch.share and self.sp is None \
            else None
        if shared is not None:
            return shared
        logprobs, rows = target_logprobs(model, batch.collated, self.device, chunked, self.sp)
        n = batch.collated["input_ids"].shape[0]
        return torch.zeros(n, dtype=logprobs.dtype, device=logprobs.device).index_add(0, rows, logprobs)

    def _lengths(self, items: Sequence[PairItem]) -> torch.Tensor:
        """Response tokens of chosen and rejected: [m, 2]."""
        return torch.tensor([[max(1, sum(t != IGNORE_INDEX for t in it[f"{side}_labels"][1:]))
                              for side in ("chosen", "rejected")] for it in items],
                            dtype=torch.float32, device=self.device)

    def precompute(self, data: PreferenceDataset) -> torch.Tensor:
        """Reference log-prob sums [rows, 2] for every pair of `data`, in one no-grad pass."""
        out = []
        size = self.pairs_per_micro * 2  # no activations are kept: twice the training micro-batch
        self.ref_model.eval()
        with torch.no_grad():
            for start in range(0, len(data), size):
                items = [data[i] for i in range(start, min(start + size, len(data)))]
                logps = self.sequence_logps(self.ref_model, self.pair_batch(items))
                out.append(torch.stack(logps.float().chunk(2), dim=1))
        return torch.cat(out).cpu()

    def reference_logps(self, split: str, indices: Sequence[int], batch: PairBatch) -> torch.Tensor:
        """[m, 2] reference sums, from the precomputed table or a no-grad pass of the frozen reference."""
        if split in self.ref_logps:
            return self.ref_logps[split][list(indices)].to(self.device)
        with torch.no_grad():
            return torch.stack(self.sequence_logps(self.ref_model, batch).float().chunk(2), dim=1)

    def pair_loss(self, split: str, data: PreferenceDataset,
                  indices: Sequence[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair DPO losses [m] and per-pair statistics for the pairs `indices` of `data`."""
        p = self.config.dpo
        items = [data[i] for i in indices]
        batch = self.pair_batch(items)
        logps = torch.stack(self.sequence_logps(self.model, batch).float().chunk(2), dim=1)
        ref = self.reference_logps(split, indices, batch)
        if p.loss_type == "ipo":  # IPO is defined on length-averaged log-ratios
            lengths = self._lengths(items)
            logps, ref = logps / lengths, ref / lengths
        losses, chosen_r, rejected_r = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta=p.beta,
                                                loss_type=p.loss_type, label_smoothing=p.label_smoothing)
        stats = {"rewards/chosen": chosen_r, "rewards/rejected": rejected_r,
                 "rewards/margins": chosen_r - rejected_r, "accuracy": (chosen_r > rejected_r).float(),
                 "logps/chosen": logps[:, 0].detach(), "logps/rejected": logps[:, 1].detach()}
        return losses, stats


__all__ = ["DPOTrainer"]
