"""What a step logs about its batch, computed over the global batch so 1 rank and N ranks log the same."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from verl.algorithms import masked_moments
from verl.batch import RolloutBatch
from verl.distributed.placement import Placement


def source_metrics(batch: RolloutBatch, placement: Placement, sources: tuple[str, list[str]]) -> dict[str, float]:
    """`reward/mean/<source>` per training source, over the global batch: `sources` is (the row key, the
    names), the same on every rank (the mixture's sources, or the data_sources of the training rows). With a
    mixture, `mixture/<name>/share` is the share of the step's responses drawn from each source. A source
    no row of this step came from has no metric this step."""
    key, names = sources
    index = {name: i for i, name in enumerate(names)}
    of = torch.tensor([index.get(row.get(key), -1) for row in batch.rows], dtype=torch.long)
    scores = batch.scores.detach().double().cpu()
    sums = torch.zeros(2, len(names), dtype=torch.float64)
    known = of >= 0
    sums[0].index_add_(0, of[known], scores[known])
    sums[1].index_add_(0, of[known], torch.ones(int(known.sum()), dtype=torch.float64))
    total, count = placement.all_reduce_sum(sums.flatten(), role="actor").view(2, -1).tolist()
    metrics = {f"reward/mean/{name}": total[i] / count[i] for i, name in enumerate(names) if count[i] > 0}
    if key != "data_source":
        metrics |= {f"mixture/{name}/share": count[i] / max(sum(count), 1.0) for i, name in enumerate(names)}
    return metrics


def batch_metrics(batch: RolloutBatch, placement: Placement,
                  sources: tuple[str, list[str]] | None = None) -> dict[str, float]:
    """Rewards, lengths, truncation and advantages of a scored batch: means and spreads from sums over the
    actor ranks, maxima by max; the stages' own measurements (`batch.metrics`) are added as they are; per
    training source with `sources` (`source_metrics`)."""
    scores, mask = batch.scores, batch.response_mask.float()
    lengths = mask.sum(-1)

    def reduce(values: torch.Tensor) -> torch.Tensor:
        return placement.all_reduce_sum(values, role="actor")

    count, total, squares = reduce(masked_moments(scores, torch.ones_like(scores))).tolist()
    mean = total / max(count, 1.0)
    std = math.sqrt(max(squares - total * mean, 0.0) / (count - 1)) if count > 1 else 0.0
    metrics = {"reward/mean": float(scores.mean()), "reward/std": std,
               "response/length_mean": float(lengths.mean()),
               "response/length_max": float(placement.all_reduce_max(lengths.max().reshape(1), "actor")),
               "response/truncation_ratio": float((~batch.finished).float().mean()),
               "prompt/length_mean": float(batch.prompt_mask.float().sum(-1).mean())}
    if bool(((scores == 0) | (scores == 1)).all()):
        metrics["reward/accuracy"] = float(scores.mean())
    _, inverse = torch.unique(batch.group_ids.to(scores.device), return_inverse=True)
    g_max = torch.full((int(inverse.max()) + 1,), -float("inf"), device=scores.device).scatter_reduce(
        0, inverse, scores, "amax")
    g_min = torch.full_like(g_max, float("inf")).scatter_reduce(0, inverse, scores, "amin")
    metrics["reward/zero_std_group_frac"] = float((g_max == g_min).float().mean())
    metrics |= batch.metrics
    if sources is not None:
        metrics |= source_metrics(batch, placement, sources)
    adv_count, adv_sum, _ = reduce(masked_moments(batch.advantages, mask)).tolist()
    metrics["advantages/mean"] = adv_sum / max(adv_count, 1.0)  # token-weighted over the global batch
    return metrics


@contextmanager
def timed(timing: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time to `timing[name]` (a stage may run several times a step)."""
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


__all__ = ["batch_metrics", "timed"]
