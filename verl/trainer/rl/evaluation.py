"""Validation metrics: n answers per held-out row, scored as training scores them, reduced over the ranks.

The trainer's validation (`RLTrainer.evaluate`) and `verl eval` both end here, so the numbers a run logs
are the numbers `verl eval` prints for the same checkpoint, rows and sampling. How answers are produced
(single responses or multi-turn episodes) is the caller's `answer`; this module chunks the rows, keeps
each row's n answers together and reduces per-row estimates (verl.algorithms.pass_at_k) over the ranks:

- `score`: the mean score of every answer; `accuracy` as well when every score is 0 or 1;
- for each k of `rollout.val_k` (default: k = n when n > 1): `pass@k` (0/1 scores; `best@k`, the expected
  best score of k answers, otherwise), `maj@k` (majority vote over the answers' extracted answers; see
  `vote_keys`) and `mean@k` (the expected mean score of k answers, which is `score` for every k);
- each of them per `data_source` when the rows mix several.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl.algorithms.pass_at_k import answer_ids, best_at_k, maj_at_k
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment
from verl.errors import ConfigError

# Non-numeric extras of a reward function's dict return that hold the answer it extracted (volcengine/verl's
# math_dapo returns it as `pred`): the majority vote compares these.
ANSWER_EXTRAS = ("pred", "answer", "extracted_answer")
AT_K_METRICS = ("pass", "best", "maj", "mean")  # the metric@k families, for names like val/pass@4

AnswerExtractor = Callable[[Sequence[str], Sequence[Any]], list[Any]]  # (responses, data sources) -> answers


@dataclass
class Answers:
    """What one chunk of rows got: `scores` [rows * n] with a row's n answers consecutive, their texts, each
    answer's non-numeric reward extras, and (episodes) means over the chunk's episodes."""

    scores: torch.Tensor
    responses: list[str]
    extras: list[dict[str, Any]] = field(default_factory=list)
    episode_metrics: dict[str, float] = field(default_factory=dict)


def validation_answers(result: Any, responses: Sequence[str], rows: Sequence[Mapping[str, Any]],
                       val_rewards: Any = None) -> Answers:
    """Validation's answers scored by the training reward (`result`), or by `reward.val_functions`
    (`val_rewards`, a RewardManager) with the training reward kept next to it (a metric and each sample's
    `training_reward`), so a policy that pleases its reward model without being right shows (reward hacking)."""
    if val_rewards is None:
        return Answers(result.scores, responses, extras=list(result.extras))
    truth = val_rewards.score([x.get("prompt") for x in rows], responses, [x.get("ground_truth") for x in rows],
                              [x.get("metadata") or {} for x in rows], [x.get("data_source") for x in rows])
    trained = result.scores.float().cpu()
    return Answers(truth.scores, responses, extras=[{**x, "training_reward": float(t)} for x, t in
                                                    zip(truth.extras, trained.tolist(), strict=True)],
                   episode_metrics={"training_reward": float(trained.mean())})


def validation_generator(seed: int, step: int, rank: int, device: torch.device) -> torch.Generator:
    """The sampling stream of a validation: derived from (seed, step, rank) alone, so sampled validation is
    reproducible, survives a resume and never shifts the training samples."""
    entropy = np.random.SeedSequence([seed, step, rank, 1])
    return torch.Generator(device=device).manual_seed(int(entropy.generate_state(1)[0]))


def answer_extractor(env: Environment | MultiTurnEnvironment) -> AnswerExtractor | None:
    """The environment's reward functions' answer extraction (`RewardManager.extracted_answers`), if any."""
    manager = getattr(env, "reward_manager", None)
    return getattr(manager, "extracted_answers", None)


def validation_ks(n: int, ks: Sequence[int] = ()) -> list[int]:
    """The k values of metric@k: `ks` (sorted, each once), or [n] when none are given and n > 1."""
    return sorted(set(ks)) if ks else ([n] if n > 1 else [])


def check_ks(n: int, ks: Sequence[int], *, n_key: str = "rollout.val_n", k_key: str = "rollout.val_k") -> None:
    """Refuse a k that n answers per prompt cannot estimate (k > n) or that is not a positive integer."""
    bad = [k for k in ks if k < 1]
    if bad:
        raise ConfigError(f"{k_key}={list(ks)}: {bad} must be positive (k answers per prompt). Fix: use k >= 1")
    big = [k for k in ks if k > n]
    if big:
        raise ConfigError(f"{k_key}={list(ks)}: pass@k, maj@k and mean@k for k={big} need at least {max(big)} "
                          f"answers per prompt, and {n_key}={n} samples {n}. Fix: raise {n_key} to {max(big)} "
                          f"or drop {big} from {k_key}")


def vote_keys(responses: Sequence[str], extras: Sequence[Mapping[str, Any]],
              extracted: Sequence[Any] | None = None) -> list[str]:
    """What each answer votes for in maj@k: the answer a reward function extracted (a `pred`/`answer`/
    `extracted_answer` extra of its dict return, else `extracted[j]`, what the first reward function with an
    `extract_answer` gave), else the response text with surrounding whitespace removed."""
    keys = []
    for j, response in enumerate(responses):
        found = None
        for values in (extras[j] if j < len(extras) else {}).values():
            found = next((values[name] for name in ANSWER_EXTRAS if isinstance(values, Mapping)
                          and values.get(name) is not None), None)
            if found is not None:
                break
        if found is None and extracted is not None:
            found = extracted[j]
        keys.append(str(found) if found is not None else response.strip())
    return keys


def row_stats(scores: torch.Tensor, keys: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """float64 [rows, 2 + 2 * len(ks)] per row: its score sum, how many scores are neither 0 nor 1, then for
    each k its best@k (= pass@k for 0/1 scores) and maj@k; sums of these columns reduce over ranks."""
    scores = scores.double()
    cols = [scores.sum(dim=1), ((scores != 0) & (scores != 1)).sum(dim=1).double()]
    for k in ks:
        cols += [best_at_k(scores, k), maj_at_k(keys, scores, k)]
    return torch.stack(cols, dim=1)


def stat_metrics(sums: Sequence[float], rows: int, n: int, ks: Sequence[int]) -> dict[str, float]:
    """The metrics of summed `row_stats` columns over `rows` rows of n answers (names without a prefix)."""
    score_sum, not_binary = sums[0], sums[1]
    metrics = {"score": score_sum / (rows * n)}
    if not_binary == 0:
        metrics["accuracy"] = metrics["score"]
    for i, k in enumerate(ks):
        metrics[f"{'pass' if not_binary == 0 else 'best'}@{k}"] = sums[2 + 2 * i] / rows
    metrics |= {f"maj@{k}": sums[3 + 2 * i] / rows for i, k in enumerate(ks)}
    return metrics | {f"mean@{k}": metrics["score"] for k in ks}


def evaluate_rows(rows: Sequence[Mapping[str, Any]], answer: Callable[[list[Mapping[str, Any]]], Answers], *,
                  n: int, chunk_size: int, dp_rank: int, dp_size: int,
                  all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], prefix: str = "val",
                  ks: Sequence[int] = (), samples: list[dict[str, Any]] | None = None, max_samples: int = 0,
                  extract_answers: AnswerExtractor | None = None, progress: Callable[[int], None] | None = None,
                  report: dict[str, Any] | None = None) -> dict[str, float]:
    """Mean score, accuracy and metric@k (per data source when the rows mix several) of `answer` on `rows`.

    Each data-parallel rank answers a contiguous share of `rows` and the sums are reduced, so every rank
    must call this with the same rows. Every rank runs the same number of chunks (a rank whose share ran out
    answers one row it then drops), so the weight gathers of a sharded policy stay in step. With `samples`,
    up to `max_samples` of {prompt, response, score, ground_truth, data_source} (each row's first answer)
    go into it. `ks`: the k of metric@k (`validation_ks`). `extract_answers(responses, data_sources)`: the
    reward functions' extracted answers for the vote (`vote_keys`). `progress(rows done)` after each chunk
    (this rank's rows). `report`, when given, receives {"overall": ..., "by_data_source": {source: ...}}
    with unprefixed names, every source listed even when there is one (what `verl eval` writes)."""
    ks = validation_ks(n, ks)
    check_ks(n, ks)
    share = -(-len(rows) // dp_size)
    mine = list(rows[dp_rank * share : (dp_rank + 1) * share])
    scores, keys, episode_sums, mine_sources = [torch.zeros(0, n)], [], {}, []
    for start in range(0, share, chunk_size):
        chunk = mine[start : start + chunk_size]
        real = len(chunk)
        out = answer(chunk or [rows[0]])
        for k, v in out.episode_metrics.items():
            episode_sums[k] = episode_sums.get(k, 0.0) + v * real
        chunk_scores = out.scores.float().cpu().view(-1, n)
        scores.append(chunk_scores[:real])
        responses = out.responses[: real * n]
        extracted = (extract_answers(responses, [row.get("data_source") for row in chunk for _ in range(n)])
                     if extract_answers is not None and ks else None)
        votes = vote_keys(responses, out.extras, extracted)
        keys += [votes[i * n : (i + 1) * n] for i in range(real)]
        mine_sources += [row.get("data_source") for row in chunk]
        if samples is not None:
            extras = out.extras[::n]
            kept = min(max(max_samples - len(samples), 0), real)
            samples += [{"prompt": row.get("prompt"), "response": response, "score": float(score),
                         "ground_truth": row.get("ground_truth"), "data_source": row.get("data_source"),
                         **({"reward_extras": extras[j]} if j < len(extras) and extras[j] else {})}
                        for j, (row, response, score) in enumerate(zip(chunk[:kept], out.responses[::n][:kept],
                                                                       chunk_scores[:kept, 0].tolist(), strict=True))]
        if progress is not None:
            progress(min(start + chunk_size, len(mine)))
    stats = row_stats(torch.cat(scores), answer_ids(keys).view(-1, n), ks)
    names = sorted(episode_sums)
    counts = Counter(row.get("data_source") for row in rows)
    sources = sorted(counts, key=str) if len(counts) > 1 or report is not None else []
    index = {source: i for i, source in enumerate(sources)}
    of = torch.tensor([index.get(source, -1) for source in mine_sources], dtype=torch.long)
    width = stats.shape[1]
    sums = torch.cat([stats.sum(dim=0), torch.tensor([episode_sums[k] for k in names], dtype=torch.float64),
                      *(stats[of == i].sum(dim=0) for i in range(len(sources)))])
    totals = all_reduce_sum(sums).tolist()
    overall = stat_metrics(totals[:width], len(rows), n, ks)
    overall |= {k: v / len(rows) for k, v in zip(names, totals[width : width + len(names)], strict=True)}
    grouped = {}
    for i, source in enumerate(sources):
        at = width + len(names) + width * i
        grouped[source] = stat_metrics(totals[at : at + width], counts[source], n, ks)
    if report is not None:
        report.update(overall=overall, by_data_source={str(s): m for s, m in grouped.items()})
    metrics = {f"{prefix}/{k}": v for k, v in overall.items()}
    for source, part in grouped.items() if len(counts) > 1 else ():
        metrics |= {f"{prefix}/{source}/{k}": v for k, v in part.items()}
    return metrics


__all__ = ["ANSWER_EXTRAS", "AT_K_METRICS", "Answers", "answer_extractor", "check_ks", "evaluate_rows", "row_stats",
           "stat_metrics", "validation_generator", "validation_ks", "vote_keys"]
