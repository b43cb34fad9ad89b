"""The update: which rows go into which micro-batch, and the optimize loop over them.

`optimize` runs epochs x shuffled mini-batches x micro-batches with gradient accumulation, weighting each
micro-batch's loss by its share of the global mini-batch, so that the accumulated gradient is one big
batch's however it is split (micro-batch size, token budget, skipped rows, data-parallel ranks). The
functions take the parts they use (module, optimizer, plan, placement, config section), never a trainer,
so the actor's and the critic's updates are the same code with their own plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl.algorithms import aggregate_loss, kl_penalty, masked_mean, value_loss
from verl.algorithms.distill import reverse_kl_loss
from verl.algorithms.entropy import AdaptiveEntropyController, masked_quantiles, top_entropy_mask
from verl.algorithms.policy_losses import get_policy_loss
from verl.algorithms.rollout_correction import Correction, rollout_correction
from verl.batch import PROMPT, RESPONSE, RolloutBatch, fields_of
from verl.config.schema import ActorConfig, CriticConfig, DistillConfig, OptimConfig
from verl.distributed.offload import activations_offloaded
from verl.distributed.placement import Placement
from verl.errors import RolloutError
from verl.models.dropout import no_grad_eval
from verl.trainer.forward.batch_math import BatchPlan
from verl.trainer.rl.correction import CorrectionPlan, explicit_plan

PROMPT_FIELDS = fields_of(PROMPT)  # [N, P], left-padded: a trim cuts the left
RESPONSE_FIELDS = fields_of(RESPONSE)  # [N, R], right-padded: a trim cuts the right

# A micro-batch's loss and its metrics as 0-dim tensors: they stay on the device until the step's end.
MicroLoss = Callable[[RolloutBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
ClipAndStep = Callable[[torch.nn.Module, torch.optim.Optimizer, "float | None", Any], float]


# ---------------------------------------------------------------------- micro-batch planning
def update_order(batch: RolloutBatch, shuffle: bool, keep_groups: bool,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """The order rows enter mini-batches: shuffled rows, or shuffled groups with their rows together."""
    n = len(batch)
    if not shuffle:
        return torch.arange(n)
    if not keep_groups:
        return torch.randperm(n, generator=generator)
    ids, inverse = torch.unique(batch.group_ids.cpu(), return_inverse=True)
    rank = torch.empty(len(ids), dtype=torch.long)
    rank[torch.randperm(len(ids), generator=generator)] = torch.arange(len(ids))
    return torch.argsort(rank[inverse], stable=True)


def micro_batch_groups(batch: RolloutBatch, size: int, max_tokens: int | None = None, *,
                       keep: torch.Tensor | None = None, by_group: bool = False,
                       packed: bool = False) -> list[torch.Tensor]:
    """Row indices of each micro-batch: `size` rows at a time in batch order, or, with a token budget,
    rows sorted by length and packed while (rows x (longest prompt + longest response)) <= max_tokens, or
    with `packed` (remove_padding: no padding is run) while the rows' lengths sum to at most max_tokens
    (a row longer than the budget goes alone). A row's length is what the forward runs on: its attended
    tokens, a multi-turn episode's observations included. Rows with `keep` False are left out. `by_group`
    sorts by the group's longest row instead, so that the rows of a group stay next to each other."""
    rows = torch.arange(len(batch)) if keep is None else keep.nonzero().flatten()
    if max_tokens is None:
        return [rows[s : s + size] for s in range(0, len(rows), size)]
    prompt_len = batch.prompt_mask.sum(-1).cpu()[rows]
    response_len = batch.response_attention.sum(-1).cpu()[rows].clamp(min=1)
    length = prompt_len + response_len
    if by_group:
        _, inverse = torch.unique(batch.group_ids.cpu()[rows], return_inverse=True)
        longest = torch.zeros(int(inverse.max()) + 1 if len(rows) else 0, dtype=length.dtype)
        longest = longest.scatter_reduce(0, inverse, length, "amax")
        by_id = torch.argsort(inverse, stable=True)
        order = by_id[torch.argsort(longest[inverse][by_id], descending=True, stable=True)]
    else:
        order = torch.argsort(length, descending=True, stable=True)
    groups: list[torch.Tensor] = []
    current: list[int] = []
    width_p = width_r = total = 0
    for j in order.tolist():
        p, r = max(width_p, int(prompt_len[j])), max(width_r, int(response_len[j]))
        cost = total + int(length[j]) if packed else (len(current) + 1) * (p + r)
        if current and cost > max_tokens:
            groups.append(rows[torch.tensor(current)])
            current, p, r, total = [], int(prompt_len[j]), int(response_len[j]), 0
        current.append(j)
        width_p, width_r, total = p, r, total + int(length[j])
    if current:
        groups.append(rows[torch.tensor(current)])
    return groups


def micro_batch(batch: RolloutBatch, index: torch.Tensor, *, trim: bool = False) -> RolloutBatch:
    """Rows `index`; with `trim`, without the padding columns none of them needs (left of the longest
    prompt, right of the longest attended response; at least one response column)."""
    mb = batch.select(index)
    if not trim:
        return mb
    p = int(mb.prompt_mask.sum(-1).max()) if len(mb) else 0
    # the attended response tokens: a multi-turn episode's observations lie inside it with mask 0
    r = max(int(mb.response_attention.sum(-1).max()) if len(mb) else 0, 1)
    for name in PROMPT_FIELDS:
        value = getattr(mb, name)
        if value is not None:
            setattr(mb, name, value[:, value.shape[1] - p :])
    for name in RESPONSE_FIELDS:
        value = getattr(mb, name)
        if value is not None:
            setattr(mb, name, value[:, :r])
    return mb


def micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
    for start in range(0, len(batch), size):
        yield batch.select(torch.arange(start, min(start + size, len(batch))))


def micro_batch_rounds(count: int, placement: Placement, role: str) -> int:
    """The micro-batch count every rank of `role` runs: the largest of theirs (at least 1, so that a rank
    with nothing to do still steps its optimizer on a zero gradient, as the full computation would)."""
    if placement.role_size(role) > 1:
        count = int(placement.all_reduce_max(torch.tensor([float(count)]), role))
    return max(count, 1)


def micro_weights(mini: RolloutBatch, groups: Sequence[torch.Tensor], agg: str, placement: Placement,
                  role: str = "actor", replicas: int = 1) -> list[float]:
    """Each micro-batch's share of the global mini-batch (tokens for token-mean, else sequences).

    Shares are of the total over the role's data-parallel ranks, times the number of ranks because FSDP
    averages gradients: the accumulated gradient is that of one big batch, however it is split. Rows
    left out of every group (skipped) still count in the total. `replicas` ranks hold the same rows (a
    sequence-parallel group): the sum over ranks counts each row that many times, and FSDP's average over
    all ranks must sum their gradients (each the part through its own tokens), not average them.
    """
    mask = mini.response_mask
    units = (mask.sum(-1) if agg == "token-mean" else (mask.sum(-1) > 0).long()).cpu()
    total = max(float(placement.all_reduce_sum(units.sum().double().reshape(1), role)) / replicas, 1.0)
    ranks = placement.role_size(role)
    return [float(units[g].sum()) * ranks / total for g in groups]


def forward_in_micro_batches(model: torch.nn.Module, batch: RolloutBatch, fn: Callable[[RolloutBatch], torch.Tensor],
                             size: int, max_tokens: int | None = None, packed: bool = False,
                             rounds: Callable[[int], int] | None = None) -> torch.Tensor:
    """`fn` over micro-batches of `size` rows, without gradient and in eval mode: dropout would make the old
    log-probs differ from the policy that sampled, and PPO's ratio start away from 1.

    `size` is the update's micro-batch size of the role that owns `model`, not a larger one: a matmul's
    float32 sums can depend on its row count (MKL on some CPUs), and with equal sizes the old and reference
    log-probs (and the values) equal the update's first forward bit for bit. With a token budget the rows
    are grouped by length and trimmed of padding; the [rows, r] results are padded back to the batch's
    response width (zeros) and returned in the batch's order.

    `rounds(count)` is the number of forwards every rank sharding `model` runs (`micro_batch_rounds`): with a
    token budget the ranks' rows split into different numbers of micro-batches, and each FSDP forward
    all-gathers, so a rank with fewer runs extra forwards of one row, their results dropped."""
    with no_grad_eval(model):
        if max_tokens is None:
            groups = [torch.arange(start, min(start + size, len(batch))) for start in range(0, len(batch), size)]
        else:
            groups = micro_batch_groups(batch, size, 2 * max_tokens, packed=packed)
        agreed = rounds(len(groups)) if rounds is not None else len(groups)  # before any forward's all-gather
        parts = [fn(micro_batch(batch, index, trim=max_tokens is not None)) for index in groups]
        for _ in range(len(groups), agreed):
            fn(micro_batch(batch, torch.zeros(1, dtype=torch.long), trim=True))  # the collectives only
        if max_tokens is None:
            return torch.cat(parts, dim=0)
        out = parts[0].new_zeros((len(batch), batch.response_ids.shape[1], *parts[0].shape[2:]))
        for index, part in zip(groups, parts, strict=True):
            out[index.to(out.device), : part.shape[1]] = part
        return out


# ---------------------------------------------------------------------- metrics of an update
@dataclass(frozen=True)
class MetricKinds:
    """How the optimize loop combines a micro-batch metric into the mini-batch's value.

    Every metric is weighted by each micro-batch's share of the global mini-batch, so the value is the one a
    single big batch would give, however the rows were split. The share is the loss aggregation's (tokens
    for token-mean, sequences otherwise) unless the metric is in `per_token` (a fraction or mean over
    tokens: clip fractions, approx_kl). Rows left out of the forward (zero advantage, skipped) count with
    their true value 0 for loss-type metrics (their loss, clip and KL terms are exactly 0); a metric in
    `ran_rows` (entropy, approx_kl, importance weights: a skipped row's value is not 0 but unknown without
    its forward) is the mean over the rows that ran instead, an estimate of the whole batch's. So skipping,
    which leaves the gradient unchanged, leaves the logged loss and clip fraction unchanged too (what TRL and
    verl users read as the batch's), and the entropy stays the policy's mean entropy, not scaled down by the
    share of skipped rows. On several ranks the loss-type metrics are exact after the mean over the ranks;
    the `ran_rows` ones are the mean of each rank's mean.
    """

    per_token: frozenset[str] = frozenset()
    ran_rows: frozenset[str] = frozenset()
    maxima: frozenset[str] = frozenset()  # the largest value of any micro-batch (this rank's)
    minima: frozenset[str] = frozenset()  # the smallest


@dataclass
class _MetricSums:
    kinds: MetricKinds
    sums: dict[str, Any] = field(default_factory=dict)  # 0-dim tensors, converted in result()
    counts: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    def add_step(self, stats: Sequence[tuple[dict[str, Any], float, float]]) -> None:
        """One optimizer step's micro-batches: (stats, share of the loss units, share of the tokens)."""
        self.steps += 1
        for key in stats[0][0] if stats else ():
            if key in self.kinds.maxima or key in self.kinds.minima:
                values = torch.stack([torch.as_tensor(v) for v in ([s[key] for s, _, _ in stats]
                                                                   + ([self.sums[key]] if key in self.sums else []))])
                self.sums[key] = values.amax() if key in self.kinds.maxima else values.amin()  # on the device
                continue
            token = key in self.kinds.per_token
            value = sum(s[key] * (tw if token else w) for s, w, tw in stats)
            if key in self.kinds.ran_rows:
                ran = sum(tw if token else w for _, w, tw in stats)
                if ran <= 0:
                    continue
                value /= ran
                self.counts[key] = self.counts.get(key, 0) + 1
            self.sums[key] = self.sums.get(key, 0.0) + value

    def result(self, pad_stats: dict[str, Any]) -> dict[str, float]:
        out = {}
        for key in [*self.sums, *(k for k in pad_stats if k not in self.sums)]:
            if key in self.kinds.maxima or key in self.kinds.minima:
                out[key] = float(self.sums.get(key, pad_stats.get(key, 0.0)))
            elif key in self.kinds.ran_rows:
                count = self.counts.get(key, 0)
                out[key] = float(self.sums[key] / count if count else pad_stats.get(key, 0.0))
            else:  # over every row: a step whose rows were all skipped adds 0
                out[key] = float(self.sums.get(key, 0.0) / max(self.steps, 1))
        return out


# How the losses' metrics combine: clip fractions and approx_kl are shares/means over tokens; entropy,
# approx_kl and the importance weights of rows the update skipped are unknown without their forward.
# The rollout correction's token means likewise; its ratio extremes are the largest / smallest.
_CORRECTION_MEANS = frozenset(f"rollout_corr/{k}" for k in ("ratio_mean", "weight_mean", "truncated_frac",
                                                            "masked_frac", "kl_k1", "kl_k3"))
ACTOR_METRICS = MetricKinds(
    per_token=frozenset({"actor/clipfrac", "actor/approx_kl"}) | _CORRECTION_MEANS,
    ran_rows=frozenset({"actor/entropy", "actor/approx_kl"}) | _CORRECTION_MEANS,
    maxima=frozenset({"rollout_corr/ratio_max"}), minima=frozenset({"rollout_corr/ratio_min"}))
CRITIC_METRICS = MetricKinds(per_token=frozenset({"critic/clipfrac"}))
# Entropy quantiles over each micro-batch's tokens (averaged over micro-batches, as the entropy is): per token,
# unknown for skipped rows.
ENTROPY_QUANTILES = {"actor/entropy_q10": 0.1, "actor/entropy_q50": 0.5, "actor/entropy_q90": 0.9}
_ENTROPY_TOKEN_METRICS = {*ENTROPY_QUANTILES, "actor/entropy_top_frac"}
ACTOR_METRICS = dataclasses.replace(ACTOR_METRICS, per_token=ACTOR_METRICS.per_token | _ENTROPY_TOKEN_METRICS,
                                    ran_rows=ACTOR_METRICS.ran_rows | _ENTROPY_TOKEN_METRICS)


# ---------------------------------------------------------------------- the micro-batch losses
def correct_rollout(old_logprobs: torch.Tensor, mb: RolloutBatch, plan: CorrectionPlan) -> Correction | None:
    """`plan`'s rollout correction of `mb` (verl.algorithms.rollout_correction): None when it is off, or when
    mode=auto meets a batch without the sampler's log-probs (an explicit mode is refused then)."""
    if plan.mode == "off" or (mb.rollout_logprobs is None and plan.auto):
        return None
    if mb.rollout_logprobs is None:
        raise RolloutError(f"actor.rollout_correction.mode={plan.mode} weighs each token by the sampler's "
                           "probability, but the rollout engine returned no log-probs. Fix: use an engine that "
                           "returns them (hf, vllm) or set actor.rollout_correction.mode=auto (or off)")
    s = plan.settings
    return rollout_correction(old_logprobs.detach(), mb.rollout_logprobs, mb.response_mask, plan.mode, cap=s.cap,
                              lo=s.lo, hi=s.hi)


def policy_loss(cfg: ActorConfig, norm_len: int, forward: Callable[[RolloutBatch], tuple[torch.Tensor, torch.Tensor]],
                *, on_logprobs: Callable[[torch.Tensor, RolloutBatch], None] | None = None,
                on_traced: Callable[[RolloutBatch, dict[str, torch.Tensor]], None] | None = None,
                entropy_coef: float | None = None, correction: CorrectionPlan | None = None,
                distill: DistillConfig | None = None) -> MicroLoss:
    """The actor's micro-batch loss: `cfg.policy_loss` from the registry with its options and aggregation, each
    token weighted (or rejected) by the rollout `correction` (default: `cfg.rollout_correction` with auto = off;
    the trainer passes `plan_correction`'s), minus the entropy bonus, plus the KL loss; and its
    metrics. `forward(mb)` gives (log-probs, entropy); `on_logprobs(logprobs, mb)` sees every forward's
    log-probs (the drift check); `on_traced(mb, values)` gets the per-token values of a micro-batch that holds
    traced rows (`mb.trace_ids`, `verl.trainer.rl.trace`). `norm_len` is seq-mean-token-sum-norm's constant for
    the whole batch. A rejected token gets weight 0 but stays in the loss normaliser, which then does not depend
    on how the batch is cut into micro-batches. `entropy_coef` is this step's bonus coefficient (the adaptive
    controller's; default `cfg.entropy_coef`). With `cfg.entropy_top_fraction` < 1 only the highest-entropy
    tokens of the micro-batch carry advantage (`top_entropy_mask`; the paper's batch is our micro-batch: one
    micro-batch per mini-batch reproduces it). `distill` in mode=loss adds its coef x the reverse-KL loss to
    the batch's teacher log-probs (`verl.algorithms.distill.reverse_kl_loss`)."""
    distill_coef = distill.coef if distill is not None and distill.mode == "loss" else 0.0
    coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    plan = correction or explicit_plan(cfg.rollout_correction)
    pg_loss, pg_options = get_policy_loss(cfg.policy_loss), cfg.loss_kwargs()  # actor.policy_loss's function

    def micro_loss(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb.response_mask.float()
        logprobs, entropy = forward(mb)
        if on_logprobs is not None:
            on_logprobs(logprobs.detach(), mb)
        old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
        entropy_stats = dict(zip(ENTROPY_QUANTILES, masked_quantiles(entropy.detach(), mask,
                                                                     tuple(ENTROPY_QUANTILES.values())), strict=True))
        if cfg.entropy_top_fraction < 1.0:  # the other tokens add 0 to the PG loss but stay in its normaliser
            top = top_entropy_mask(entropy.detach(), mask, cfg.entropy_top_fraction)
            mb = dataclasses.replace(mb, advantages=mb.advantages * top.to(mb.advantages))
            entropy_stats["actor/entropy_top_frac"] = masked_mean(top, mask)
        corrected = correct_rollout(old, mb, plan)
        weights = None if corrected is None else corrected.weights
        if on_traced is not None and mb.trace_ids is not None and bool((mb.trace_ids >= 0).any()):
            on_traced(mb, {"logprob": logprobs.detach(), "entropy": entropy.detach(), "old": old.detach(),
                           **({} if weights is None else {"rollout_corr_weight": weights})})
        loss, stats = pg_loss(logprobs, old, mb.advantages, mask, agg=cfg.loss_agg, norm_len=norm_len,
                              token_weights=weights, **pg_options)
        metrics = {"actor/pg_loss": loss.detach(), "actor/clipfrac": stats["clipfrac"],
                   "actor/approx_kl": stats["approx_kl"]}
        if corrected is not None:
            metrics |= {f"rollout_corr/{k}": v for k, v in corrected.metrics.items()}
        ent = aggregate_loss(entropy, mask, cfg.loss_agg, norm_len=norm_len)
        metrics["actor/entropy"] = ent.detach()
        metrics |= entropy_stats
        if coef > 0:
            loss = loss - coef * ent
        if cfg.kl_loss_coef > 0:
            kl = aggregate_loss(kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_loss_type), mask, cfg.loss_agg,
                                norm_len=norm_len)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        if distill_coef > 0:
            kd = aggregate_loss(reverse_kl_loss(logprobs, mb.teacher_logprobs), mask, cfg.loss_agg, norm_len=norm_len)
            loss = loss + distill_coef * kd
            metrics["actor/distill_loss"] = kd.detach()
        return loss, metrics

    return micro_loss


def critic_loss(cfg: CriticConfig, norm_len: int, values: Callable[[RolloutBatch], torch.Tensor]) -> MicroLoss:
    """The critic's micro-batch loss (clipped value loss) and its metrics; `values(mb)` runs the critic.
    `norm_len` is one constant for the whole batch, as the actor's, so that the gradient does not depend on
    how the batch is cut into (trimmed) micro-batches."""

    def micro_loss(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb.response_mask.float()
        loss, stats = value_loss(values(mb), mb.values, mb.returns, mask, clip_range=cfg.value_clip, agg=cfg.loss_agg,
                                 norm_len=norm_len)
        return loss, {"critic/vf_loss": loss.detach(), **{f"critic/{k}": v for k, v in stats.items()}}

    return micro_loss


# ---------------------------------------------------------------------- the optimize loop
def optimize(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batch: RolloutBatch,
    cfg: OptimConfig,
    plan: BatchPlan,
    micro_loss: MicroLoss,
    *,
    placement: Placement,
    clip_and_step: ClipAndStep,
    prefix: str,
    generator: torch.Generator | None = None,
    contributes: Callable[[RolloutBatch], torch.Tensor] | None = None,
    keep_groups: bool = False,
    before_step: Callable[[], None] | None = None,
    metric_kinds: MetricKinds = MetricKinds(),
    replicas: int = 1,
) -> dict[str, float]:
    """Epochs x shuffled mini-batches x micro-batches; each micro loss is weighted by its share of the
    mini-batch (tokens for token-mean, sequences otherwise) so accumulation equals one big batch.

    `contributes(mini)` marks the sequences whose gradient can be non-zero; the others are left out of
    the forward/backward but still counted in the loss normaliser, so the gradient is unchanged. When
    the number of micro-batches can differ between ranks (skipping, token budgets), every rank runs the
    largest count, padding with zero-weight micro-batches: FSDP's all-gathers stay in step.
    `keep_groups` shuffles whole groups (the samples of one prompt stay together, so a shared-prompt
    forward finds them in one micro-batch). `before_step()` runs after each mini-batch's backward passes,
    before its optimizer step; `clip_and_step(module, optimizer, grad_clip, scheduler)` steps both and returns
    the gradient norm. The metrics are combined as `metric_kinds` says, then averaged over the optimizer steps.
    `replicas` ranks hold the same `batch` and each computes the gradient through its share of every
    sequence's tokens (sequence parallelism: `micro_weights`).
    """
    module.train()
    sums = _MetricSums(metric_kinds)
    grad_norms = []
    skipped = seen = 0
    pad_stats: dict[str, Any] = {}
    n = len(batch)
    budget = cfg.max_tokens_per_micro_batch
    varies = contributes is not None or budget is not None
    for _ in range(cfg.ppo_epochs):
        order = update_order(batch, cfg.shuffle, keep_groups, generator)
        for start in range(0, n, plan.mini_batch_sequences):
            mini = batch.select(order[start : start + plan.mini_batch_sequences])
            keep = contributes(mini).to("cpu", torch.bool) if contributes is not None else None
            groups = micro_batch_groups(mini, plan.micro_batch_size, budget, keep=keep, by_group=keep_groups,
                                        packed=plan.packed)
            weights = micro_weights(mini, groups, cfg.loss_agg, placement, prefix, replicas)
            token_weights = (weights if cfg.loss_agg == "token-mean" or not metric_kinds.per_token
                             else micro_weights(mini, groups, "token-mean", placement, prefix, replicas))
            rounds = micro_batch_rounds(len(groups), placement, prefix) if varies else len(groups)
            optimizer.zero_grad(set_to_none=True)
            ran: list[tuple[dict[str, Any], float, float]] = []
            for i in range(rounds):
                if i < len(groups):
                    mb, weight = micro_batch(mini, groups[i], trim=budget is not None), weights[i]
                else:  # a rank with fewer (or no) micro-batches: same collectives, zero gradient
                    mb, weight = micro_batch(mini, torch.zeros(1, dtype=torch.long), trim=True), 0.0
                    mb.trace_ids = None  # no pass of its row's (logging.token_samples)
                with activations_offloaded(cfg.activation_offload, placement.device):  # (*.activation_offload)
                    loss, stats = micro_loss(mb)
                (loss * weight).backward()
                if i < len(groups):  # a metric counts each row once, though `replicas` ranks computed it
                    ran.append((stats, weight / replicas, token_weights[i] / replicas))
                elif not pad_stats:  # its row-mean metrics are reported if nothing else ran
                    pad_stats = stats
            sums.add_step(ran)
            if keep is not None:
                skipped, seen = skipped + int((~keep).sum()), seen + len(mini)
            if before_step is not None:
                before_step()
            grad_norms.append(clip_and_step(module, optimizer, cfg.grad_clip, scheduler))
    metrics = sums.result(pad_stats)
    for key, sign in [*((k, 1.0) for k in metric_kinds.maxima), *((k, -1.0) for k in metric_kinds.minima)]:
        if key in metrics:  # this rank's extreme; the run's is over every rank of the role
            value = torch.tensor([sign * metrics[key]], device=placement.device)
            metrics[key] = sign * float(placement.all_reduce_max(value, prefix))
    metrics[f"{prefix}/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
    metrics[f"{prefix}/lr"] = scheduler.get_last_lr()[0]
    if contributes is not None:
        metrics[f"{prefix}/skipped_frac"] = skipped / max(seen, 1)
    return metrics


def norm_length(batch: RolloutBatch, max_new_tokens: int) -> int:
    """seq-mean-token-sum-norm's constant, one for the actor and the critic (Dr. GRPO: the generation budget,
    not this batch's longest response; a multi-turn episode with observations may be longer than one turn's)."""
    return max(batch.response_ids.shape[1], max_new_tokens)


def without_truncated(batch: RolloutBatch) -> RolloutBatch:
    """`actor.mask_truncated`: responses cut at the length limit out of every loss term (still attended to)."""
    if batch.finished is None:
        return batch
    keep = batch.finished.to(batch.response_mask.device, batch.response_mask.dtype)[:, None]
    return dataclasses.replace(batch, response_attention_mask=batch.response_attention,
                               response_mask=batch.response_mask * keep)


def skips_zero_advantage(cfg: ActorConfig) -> bool:
    """With neither a KL loss nor an entropy bonus the PPO loss of a token is -A x ratio (clipped), so a
    sequence whose advantages are all exactly 0 (a GRPO/RLOO group with equal rewards) has zero loss and
    zero gradient: the update may leave it out. Not with a loss that selects tokens across the
    micro-batch (clip_cov, kl_cov: not `row_local`)."""
    return (cfg.skip_zero_advantage and cfg.kl_loss_coef == 0 and cfg.entropy_coef == 0
            and cfg.target_entropy is None  # an adaptive bonus may become > 0
            and get_policy_loss(cfg.policy_loss).row_local)


def entropy_controller(cfg: ActorConfig) -> AdaptiveEntropyController | None:
    """`actor.target_entropy`'s adaptive bonus coefficient (starting at `entropy_coef`); None = fixed."""
    if cfg.target_entropy is None:
        return None
    return AdaptiveEntropyController(cfg.entropy_coef, cfg.target_entropy, cfg.entropy_coef_step, cfg.entropy_coef_max)


def steer_entropy(ctrl: AdaptiveEntropyController, metrics: dict[str, float], placement: Placement,
                  role: str = "actor") -> dict[str, float]:
    """Move the coefficient with the update's mean token entropy (`actor/entropy`, averaged over the role's
    ranks so every rank steps the same coefficient); the metrics of the coefficient this step used."""
    used = ctrl.value
    local = torch.tensor([metrics["actor/entropy"]], dtype=torch.float64)
    ctrl.update(placement.all_reduce_sum(local, role) / placement.role_size(role))
    return {f"{role}/entropy_coef": used}


def contributing_sequences(batch: RolloutBatch) -> torch.Tensor:
    """[N] bool: the sequences with a non-zero advantage on some response token."""
    return ((batch.advantages != 0) & (batch.response_mask != 0)).any(-1)


__all__ = ["norm_length", "without_truncated", "contributing_sequences", "entropy_controller", "steer_entropy",
           "ENTROPY_QUANTILES", "skips_zero_advantage", "correct_rollout", "ACTOR_METRICS", "CRITIC_METRICS",
           "MetricKinds", "critic_loss", "policy_loss", "PROMPT_FIELDS", "RESPONSE_FIELDS", "forward_in_micro_batches",
           "micro_batch", "micro_batch_groups", "micro_batch_rounds", "micro_batches", "micro_weights", "optimize",
           "update_order"]
