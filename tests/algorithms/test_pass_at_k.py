"""pass@k, best@k and maj@k against brute force: every k-subset of the n answers enumerated, in exact
fractions, with the definitions written out here independently of verl.algorithms.pass_at_k."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
import torch

from verl.algorithms import pass_at_k as pk


def brute_pass(correct: list[int], k: int) -> Fraction:
    subsets = list(itertools.combinations(range(len(correct)), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


def brute_best(scores: list[Fraction], k: int) -> Fraction:
    subsets = list(itertools.combinations(range(len(scores)), k))
    return sum((max(scores[i] for i in s) for s in subsets), Fraction(0)) / len(subsets)


def brute_maj(keys: list[str], scores: list[Fraction], k: int) -> Fraction:
    """Per subset: the keys with the most votes; each tied key equally likely; a key's score is the mean of
    its answers' scores in the subset."""
    subsets = list(itertools.combinations(range(len(keys)), k))
    total = Fraction(0)
    for s in subsets:
        votes: dict[str, list[Fraction]] = {}
        for i in s:
            votes.setdefault(keys[i], []).append(scores[i])
        most = max(len(v) for v in votes.values())
        tied = [sum(v, Fraction(0)) / len(v) for v in votes.values() if len(v) == most]
        total += sum(tied, Fraction(0)) / len(tied)
    return total / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_answer(n):
    for c in range(n + 1):
        correct = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            want = brute_pass(correct, k)
            assert want == 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # Chen et al.'s closed form
            assert pk.pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-15)


def test_pass_at_k_rows_matches_the_scalar_and_brute_force():
    rng = random.Random(0)
    n = 7
    correct = [[rng.random() < p for _ in range(n)] for p in (0.0, 0.1, 0.5, 0.9, 1.0, 0.3)]
    for k in range(1, n + 1):
        got = pk.pass_at_k_rows(torch.tensor(correct), k)
        assert got.dtype == torch.float64
        want = [float(brute_pass([int(x) for x in row], k)) for row in correct]
        assert got.tolist() == pytest.approx(want, abs=1e-15)


def test_pass_at_k_is_stable_where_binomials_overflow():
    """C(2000, 1000) overflows float64; the product form does not (reference: exact integers)."""
    n, c, k = 2000, 3, 1000
    want = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pk.pass_at_k(n, c, k) == pytest.approx(float(want), rel=1e-12)
    row = torch.zeros(1, n)
    row[0, :c] = 1
    assert float(pk.pass_at_k_rows(row, k)) == pytest.approx(float(want), rel=1e-12)


def test_best_at_k_is_the_expected_best_of_a_k_subset():
    rng = random.Random(1)
    n = 6
    rows = [[Fraction(rng.randint(0, 8), 4) for _ in range(n)] for _ in range(5)]
    rows.append([Fraction(1)] * 3 + [Fraction(0)] * 3)  # ties
    t = torch.tensor([[float(x) for x in row] for row in rows], dtype=torch.float64)
    for k in range(1, n + 1):
        assert pk.best_at_k(t, k).tolist() == pytest.approx([float(brute_best(r, k)) for r in rows], abs=1e-14)
        weights = pk.best_at_k_weights(n, k)
        assert weights.tolist() == pytest.approx([math.comb(i - 1, k - 1) / math.comb(n, k) for i in range(1, n + 1)])
        assert float(weights.sum()) == pytest.approx(1.0)


def test_best_at_k_of_0_1_scores_is_pass_at_k():
    correct = torch.tensor([[1, 0, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.float64)
    for k in range(1, 6):
        assert pk.best_at_k(correct, k).tolist() == pytest.approx(pk.pass_at_k_rows(correct, k).tolist(), abs=1e-15)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_maj_at_k_is_the_expected_majority_answer_score_with_ties_shared(k):
    rng = random.Random(k)
    n = 6
    cases = [
        (["4", "4", "5", "4", "7", "5"], [1, 1, 0, 1, 0, 0]),  # the right answer has the most votes
        (["a", "b", "a", "b", "c", "c"], [1, 0, 1, 0, 0, 0]),  # three-way ties
        (["x"] * 6, [1, 0, 1, 1, 0, 1]),  # one answer, scores that differ (the mean of them counts)
        ([str(i) for i in range(6)], [0, 0, 1, 0, 0, 0]),  # every answer different: all tie
    ]
    cases += [([rng.choice("pqr") for _ in range(n)], [rng.randint(0, 4) / 4 for _ in range(n)]) for _ in range(4)]
    keys = pk.answer_ids([c[0] for c in cases])
    scores = torch.tensor([c[1] for c in cases], dtype=torch.float64)
    got = pk.maj_at_k(keys, scores, k)
    want = [float(brute_maj(c[0], [Fraction(x).limit_denominator(8) for x in c[1]], k)) for c in cases]
    assert got.tolist() == pytest.approx(want, abs=1e-12)


def test_maj_at_n_is_the_plain_majority_vote():
    keys = pk.answer_ids([["7", "7", "3", "3", "7"], ["1", "2", "2", "9", "9"]])
    scores = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0]], dtype=torch.float64)
    assert pk.maj_at_k(keys, scores, 5).tolist() == [1.0, 0.5]  # row 2: "2" and "9" tie, one of them right


def test_maj_at_k_samples_subsets_when_there_are_too_many_and_stays_close():
    """n=16, k=8: C(16, 8) = 12870 subsets > MAJ_EXACT_SUBSETS, so a fixed-seed sample of them: the same
    number every call, within a few standard errors of the exact enumeration."""
    n, k = 16, 8
    assert math.comb(n, k) > pk.MAJ_EXACT_SUBSETS
    subsets, exact = pk.k_subsets(n, k)
    assert not exact and subsets.shape == (pk.MAJ_SAMPLED_SUBSETS, k)
    assert all(len(set(s)) == k for s in subsets.tolist())
    rng = random.Random(3)
    answers = [[rng.choice("abc") for _ in range(n)] for _ in range(3)]
    scores = torch.tensor([[float(a == "a") for a in row] for row in answers], dtype=torch.float64)
    keys = pk.answer_ids(answers)
    got = pk.maj_at_k(keys, scores, k)
    assert torch.equal(got, pk.maj_at_k(keys, scores, k))
    exact_value = []
    for row in answers:  # exact by enumeration (fast enough for 12870 subsets)
        total = 0.0
        for s in itertools.combinations(range(n), k):
            counts = {c: sum(row[i] == c for i in s) for c in set(row[i] for i in s)}
            most = max(counts.values())
            tied = [c for c, m in counts.items() if m == most]
            total += sum(c == "a" for c in tied) / len(tied)
        exact_value.append(total / math.comb(n, k))
    assert got.tolist() == pytest.approx(exact_value, abs=0.03)


def test_k_larger_than_n_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"k=5 is larger than n=4.*Sample n >= 5 answers per prompt, or use k <= 4"):
        pk.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="k=3 is larger than n=2"):
        pk.pass_at_k_rows(torch.zeros(3, 2), 3)
    with pytest.raises(ValueError, match="k=3 is larger than n=2"):
        pk.maj_at_k(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), 3)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        pk.best_at_k(torch.zeros(1, 2), 0)


def test_answer_ids_number_each_rows_answers_by_first_appearance():
    assert pk.answer_ids([["b", "a", "b"], ["x", "x", "y"]]).tolist() == [[0, 1, 0], [0, 0, 1]]
    assert pk.answer_ids([]).shape == (0, 0)
