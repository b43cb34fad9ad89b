"""What k answers per prompt would score, estimated from n >= k sampled answers: pass@k, best@k, maj@k.

Each is the expected value over the C(n, k) equally likely k-subsets of the n answers, so it uses all n
samples and is unbiased for drawing k fresh answers (reporting the first k answers instead is noisier, and
max-over-n reported as "pass@k" is biased upwards):

- pass@k (Chen et al. 2021, the Codex paper): 1 - C(n-c, k) / C(n, k) for c correct answers, the chance a
  k-subset holds at least one. Binomials overflow float64 from n ~ 1030 on, so it is the product
  1 - prod_{i=n-c+1}^{n} (1 - k/i), whose factors all lie in [0, 1].
- best@k: the expected best score of a k-subset, for scores that are not 0/1. With the scores sorted
  ascending, the i-th smallest (1-based) is a subset's best with probability C(i-1, k-1) / C(n, k); the
  weights come from the ratio of consecutive ones, (i - k) / (i - 1), again a product. For 0/1 scores it
  equals pass@k.
- maj@k: the score of the answer most of a k-subset agree on (majority vote). Answers are compared by a key
  (an integer per answer, equal keys = the same answer); the voted answer's score is the mean score of the
  subset's answers with its key. A tie between keys is broken uniformly at random, taken in expectation:
  the mean of the tied keys' scores. The expectation is exact (every k-subset enumerated) when C(n, k) is at
  most `MAJ_EXACT_SUBSETS`, otherwise estimated from `MAJ_SAMPLED_SUBSETS` random k-subsets drawn from a
  generator seeded with `seed` (reproducible; standard error below 0.5 / sqrt(4096) ~ 0.008 per prompt, and
  averaging over prompts shrinks it further). For k == n there is one subset: exact.

mean@k, the expected mean score of k answers, is the mean of all n for every k (linearity); no function.
"""

from __future__ import annotations

import itertools
import math

import torch

MAJ_EXACT_SUBSETS = 4096  # enumerate every k-subset up to this many
MAJ_SAMPLED_SUBSETS = 4096  # otherwise draw this many at random (with a fixed seed)
_MAJ_ELEMENTS = 1 << 22  # rows x subsets x n per chunk of maj_at_k (bounds its memory to ~100 MB)


def _check(n: int, k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: k must be a positive integer (the number of answers a metric@k looks at)")
    if k > n:
        raise ValueError(f"k={k} is larger than n={n}, the answers sampled per prompt: an estimate@k needs at "
                         f"least k samples. Sample n >= {k} answers per prompt, or use k <= {n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` of `n` answers correct: 1 - C(n-c, k) / C(n, k)."""
    _check(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct answers out of n={n}: c must lie in [0, n]")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_rows(correct: torch.Tensor, k: int) -> torch.Tensor:
    """pass@k per row of `correct` [rows, n] (bool or 0/1: answer j of prompt i is correct), float64 [rows]."""
    if correct.dim() != 2:
        raise ValueError(f"correct has shape {tuple(correct.shape)}; pass [rows, n] (n answers per prompt)")
    n = correct.shape[1]
    _check(n, k)
    c = (correct != 0).sum(dim=1)
    # survive[m] = prod_{i=n-m+1}^{n} (1 - k/i): the chance that none of m correct answers is in a k-subset.
    i = torch.arange(n, 0, -1, dtype=torch.float64)
    survive = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod((1.0 - k / i).clamp(min=0.0), 0)])
    return 1.0 - survive[c]


def best_at_k_weights(n: int, k: int) -> torch.Tensor:
    """float64 [n]: the chance that the i-th smallest of n scores is a random k-subset's largest,
    C(i-1, k-1) / C(n, k), built from the top (k/n for the largest) by the ratio (i - k) / (i - 1)."""
    _check(n, k)
    w = [0.0] * n
    w[n - 1] = k / n
    for i in range(n, 1, -1):  # 1-based i: w[i-1] holds the weight of the i-th smallest
        w[i - 2] = w[i - 1] * (i - k) / (i - 1) if i > k else 0.0
    return torch.tensor(w, dtype=torch.float64)


def best_at_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The expected largest score of a random k-subset of each row's n scores; float64 [rows]."""
    if scores.dim() != 2:
        raise ValueError(f"scores has shape {tuple(scores.shape)}; pass [rows, n] (n answers per prompt)")
    weights = best_at_k_weights(scores.shape[1], k)
    return (scores.double().sort(dim=1).values * weights).sum(dim=1)


def k_subsets(n: int, k: int, *, seed: int = 0) -> tuple[torch.Tensor, bool]:
    """([subsets, k] answer indices, exact): every k-subset of range(n) when there are at most
    `MAJ_EXACT_SUBSETS`, else `MAJ_SAMPLED_SUBSETS` uniformly random ones from a generator seeded with `seed`."""
    _check(n, k)
    if math.comb(n, k) <= MAJ_EXACT_SUBSETS:
        return torch.tensor(list(itertools.combinations(range(n), k)), dtype=torch.long).view(-1, k), True
    generator = torch.Generator().manual_seed(seed)
    order = torch.rand(MAJ_SAMPLED_SUBSETS, n, generator=generator, dtype=torch.float64).argsort(dim=1)
    return order[:, :k], False


def maj_at_k(keys: torch.Tensor, scores: torch.Tensor, k: int, *, seed: int = 0) -> torch.Tensor:
    """Majority-vote score per row (see the module docstring for ties and subsets); float64 [rows].

    `keys` [rows, n] integers in [0, n): answer j of prompt i votes for key keys[i, j] (equal keys: the same
    answer); `scores` [rows, n]: each answer's score."""
    if keys.shape != scores.shape or keys.dim() != 2:
        raise ValueError(f"keys {tuple(keys.shape)} and scores {tuple(scores.shape)} must both be [rows, n]")
    rows, n = keys.shape
    if rows and (int(keys.min()) < 0 or int(keys.max()) >= n):
        raise ValueError(f"keys must lie in [0, n={n}): number each row's distinct answers 0, 1, ...")
    subsets, _ = k_subsets(n, k, seed=seed)
    out = torch.empty(rows, dtype=torch.float64)
    step = max(1, _MAJ_ELEMENTS // (len(subsets) * n))
    for start in range(0, rows, step):
        key, score = keys[start : start + step].long(), scores[start : start + step].double()
        votes, got = key[:, subsets], score[:, subsets]  # [r, subsets, k]
        shape = (key.shape[0], len(subsets), n)
        counts = torch.zeros(shape, dtype=torch.float64).scatter_add_(2, votes, torch.ones_like(got))
        sums = torch.zeros(shape, dtype=torch.float64).scatter_add_(2, votes, got)
        tied = counts == counts.amax(dim=2, keepdim=True)  # the most votes (>= 1, so absent keys never tie)
        mean_of_key = sums / counts.clamp(min=1.0)
        voted = (mean_of_key * tied).sum(dim=2) / tied.sum(dim=2)
        out[start : start + step] = voted.mean(dim=1)
    return out


def answer_ids(keys: list[list[str]]) -> torch.Tensor:
    """[rows, n] integer ids of each row's answer strings, numbered by first appearance in the row."""
    ids = []
    for row in keys:
        seen: dict[str, int] = {}
        ids.append([seen.setdefault(key, len(seen)) for key in row])
    return torch.tensor(ids, dtype=torch.long) if ids else torch.zeros(0, 0, dtype=torch.long)


__all__ = ["MAJ_EXACT_SUBSETS", "MAJ_SAMPLED_SUBSETS", "answer_ids", "best_at_k", "best_at_k_weights", "k_subsets",
           "maj_at_k", "pass_at_k", "pass_at_k_rows"]
