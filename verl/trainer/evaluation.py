"""Validation metrics: n answers per held-out row, scored as training scores them, reduced over the ranks.

The aggregation lives here, apart from how answers are produced (single responses or multi-turn episodes,
`RLTrainer.evaluate` decides), so every rank runs the same chunks and the sums are exact over the ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Answers:
    """What one chunk of rows got: `scores` [rows * n] with a row's n answers consecutive, their texts, each
    answer's non-numeric reward extras, and (episodes) means over the chunk's episodes."""

    scores: torch.Tensor
    responses: list[str]
    extras: list[dict[str, Any]] = field(default_factory=list)
    episode_metrics: dict[str, float] = field(default_factory=dict)


def score_sums(scores: torch.Tensor) -> tuple[float, float, float]:
    """For [rows, n] scores (n answers per prompt): (sum of the scores, how many are neither 0 nor 1, sum over
    the rows of their best score)."""
    return float(scores.sum()), float(((scores != 0) & (scores != 1)).sum()), float(scores.amax(dim=1).sum())


def score_metrics(prefix: str, sums: Sequence[float], rows: int, n: int) -> dict[str, float]:
    """`<prefix>/score` (the mean over every answer), `<prefix>/accuracy` when every score is 0 or 1, and with
    several answers per prompt the mean of each prompt's best: `pass@n` for 0/1 scores, else `best@n`."""
    score_sum, not_binary, best_sum = sums
    metrics = {f"{prefix}/score": score_sum / (rows * n)}
    if not_binary == 0:
        metrics[f"{prefix}/accuracy"] = score_sum / (rows * n)
    if n > 1:
        metrics[f"{prefix}/{'pass' if not_binary == 0 else 'best'}@{n}"] = best_sum / rows
    return metrics


def evaluate_rows(rows: Sequence[Mapping[str, Any]], answer: Callable[[list[Mapping[str, Any]]], Answers], *,
                  n: int, chunk_size: int, dp_rank: int, dp_size: int,
                  all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], prefix: str = "val",
                  samples: list[dict[str, Any]] | None = None, max_samples: int = 0) -> dict[str, float]:
    """Mean score (and accuracy, pass@n, per data source when the rows mix several) of `answer` on `rows`.

    Each data-parallel rank answers a contiguous share of `rows` and the sums are reduced, so every rank
    must call this with the same rows. Every rank runs the same number of chunks (a rank whose share ran out
    answers one row it then drops), so the weight gathers of a sharded policy stay in step. With `samples`,
    up to `max_samples` of {prompt, response, score, ground_truth, data_source} (each row's first answer)
    go into it."""
    share = -(-len(rows) // dp_size)
    mine = list(rows[dp_rank * share : (dp_rank + 1) * share])
    scores, episode_sums, mine_sources = [torch.zeros(0, n)], {}, []
    for start in range(0, share, chunk_size):
        chunk = mine[start : start + chunk_size]
        real = len(chunk)
        out = answer(chunk or [rows[0]])
        for k, v in out.episode_metrics.items():
            episode_sums[k] = episode_sums.get(k, 0.0) + v * real
        chunk_scores = out.scores.float().cpu().view(-1, n)
        scores.append(chunk_scores[:real])
        mine_sources += [row.get("data_source") for row in chunk]
        if samples is not None:
            extras = out.extras[::n]
            kept = min(max(max_samples - len(samples), 0), real)
            samples += [{"prompt": row.get("prompt"), "response": response, "score": float(score),
                         "ground_truth": row.get("ground_truth"), "data_source": row.get("data_source"),
                         **({"reward_extras": extras[j]} if j < len(extras) and extras[j] else {})}
                        for j, (row, response, score) in enumerate(zip(chunk[:kept], out.responses[::n][:kept],
                                                                       chunk_scores[:kept, 0].tolist(), strict=True))]
    mine_scores = torch.cat(scores).double()
    names = sorted(episode_sums)
    counts = Counter(row.get("data_source") for row in rows)
    sources = sorted(counts, key=str) if len(counts) > 1 else []
    index = {source: i for i, source in enumerate(sources)}
    of = torch.tensor([index.get(source, -1) for source in mine_sources], dtype=torch.long)
    by_source = [mine_scores[of == i] for i in range(len(sources))]
    sums = torch.tensor([*score_sums(mine_scores), *(episode_sums[k] for k in names),
                         *(x for part in by_source for x in score_sums(part))], dtype=torch.float64)
    totals = all_reduce_sum(sums).tolist()
    metrics = score_metrics(prefix, totals[:3], len(rows), n)
    metrics |= {f"{prefix}/{k}": v / len(rows) for k, v in zip(names, totals[3 : 3 + len(names)], strict=True)}
    for i, source in enumerate(sources):
        at = 3 + len(names) + 3 * i
        metrics |= score_metrics(f"{prefix}/{source}", totals[at : at + 3], counts[source], n)
    return metrics


__all__ = ["Answers", "evaluate_rows", "score_metrics", "score_sums"]
