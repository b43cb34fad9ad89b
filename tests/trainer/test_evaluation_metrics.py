"""`evaluation.evaluate_rows` on scripted answers: metric@k overall and per data_source, what the majority vote
compares, and k > n refused. The expected values are enumerated here over every k-subset, in fractions."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from verl.errors import ConfigError
from verl.rewards.manager import RewardManager
from verl.trainer.rl.evaluation import Answers, evaluate_rows, validation_ks, vote_keys

# Per prompt: its data_source and its 4 answers as (text, score).
ROWS = [
    ("gsm8k", [("12", 1), ("12", 1), ("13", 0), ("7", 0)]),
    ("gsm8k", [("5", 0), ("6", 0), ("6", 0), ("5", 0)]),
    ("gsm8k", [("x", 1), ("y", 0), ("y", 0), ("y", 0)]),
    ("math", [("a", 1), ("b", 0), ("a", 1), ("c", 0)]),
    ("math", [("q", 1), ("q", 1), ("q", 1), ("q", 1)]),
]


def brute(answers: list[tuple[str, int]], k: int) -> tuple[Fraction, Fraction]:
    """(pass@k, maj@k) of one prompt: the share of k-subsets with a correct answer, and the mean over k-subsets
    of the voted answer's score (a tie between answers: each equally likely)."""
    subsets = list(itertools.combinations(answers, k))
    passed = Fraction(sum(any(s for _, s in sub) for sub in subsets), len(subsets))
    voted = Fraction(0)
    for sub in subsets:
        counts: dict[str, list[int]] = {}
        for text, score in sub:
            counts.setdefault(text, []).append(score)
        most = max(len(v) for v in counts.values())
        tied = [Fraction(sum(v), len(v)) for v in counts.values() if len(v) == most]
        voted += sum(tied, Fraction(0)) / len(tied)
    return passed, voted / len(subsets)


def scripted_rows() -> list[dict]:
    return [{"prompt": f"p{i}", "ground_truth": "", "data_source": source} for i, (source, _) in enumerate(ROWS)]


def scripted_answer(chunk: list[dict]) -> Answers:
    answers = [ROWS[int(row["prompt"][1:])][1] for row in chunk]
    return Answers(torch.tensor([float(s) for a in answers for _, s in a]), [t for a in answers for t, _ in a])


def run(rows: list[dict], ks: list[int], **kwargs) -> dict[str, float]:
    return evaluate_rows(rows, scripted_answer, n=4, ks=ks, chunk_size=2, dp_rank=0, dp_size=1,
                         all_reduce_sum=lambda t: t, prefix="val", **kwargs)


def test_metric_at_k_overall_and_per_data_source_equal_enumeration_over_k_subsets():
    metrics = run(scripted_rows(), [1, 2, 4])
    for k in (1, 2, 4):
        for source, prefix in ((None, "val"), ("gsm8k", "val/gsm8k"), ("math", "val/math")):
            picked = [answers for s, answers in ROWS if source in (None, s)]
            passed = sum(brute(a, k)[0] for a in picked) / len(picked)
            voted = sum(brute(a, k)[1] for a in picked) / len(picked)
            mean = Fraction(sum(s for a in picked for _, s in a), 4 * len(picked))
            assert metrics[f"{prefix}/pass@{k}"] == pytest.approx(float(passed), abs=1e-12)
            assert metrics[f"{prefix}/maj@{k}"] == pytest.approx(float(voted), abs=1e-12)
            assert metrics[f"{prefix}/mean@{k}"] == pytest.approx(float(mean), abs=1e-12)
            assert metrics[f"{prefix}/score"] == metrics[f"{prefix}/accuracy"] == metrics[f"{prefix}/mean@{k}"]
    assert metrics["val/maj@4"] == pytest.approx((1 + 0 + 0 + 1 + 1) / 5)  # "12", a 5/6 tie, "y", "a", "q"


def test_the_report_lists_every_source_even_one_and_the_default_k_is_n():
    report: dict = {}
    rows = scripted_rows()[:3]
    metrics = run(rows, [], report=report)
    assert validation_ks(4, []) == [4] and validation_ks(1, []) == [] and validation_ks(4, [4, 1, 4]) == [1, 4]
    assert set(metrics) == {"val/score", "val/accuracy", "val/pass@4", "val/maj@4", "val/mean@4"}
    assert set(report["by_data_source"]) == {"gsm8k"} and report["by_data_source"]["gsm8k"] == report["overall"]
    assert report["overall"]["pass@4"] == metrics["val/pass@4"]


def test_scores_that_are_not_0_or_1_give_best_at_k():
    rows = [{"prompt": "p", "data_source": "d"}]

    def answer(chunk):
        return Answers(torch.tensor([0.25, 0.5, 0.5, 1.0]), ["a", "b", "b", "c"])

    metrics = evaluate_rows(rows, answer, n=4, ks=[2], chunk_size=8, dp_rank=0, dp_size=1,
                            all_reduce_sum=lambda t: t)
    # best of a 2-subset: the pairs of (0.25, 0.5, 0.5, 1.0): 3 with 1.0, 2 with 0.5 over 0.25, 1 of the two 0.5s
    assert metrics["val/best@2"] == pytest.approx((3 * 1.0 + 3 * 0.5) / 6)
    assert "val/pass@2" not in metrics and "val/accuracy" not in metrics
    # maj@2: the pair of "b"s votes b (0.5); every other pair ties: the mean of its two scores
    pairs = list(itertools.combinations(zip("abbc", [0.25, 0.5, 0.5, 1.0], strict=True), 2))
    want = sum(x[1] if x[0] == y[0] else (x[1] + y[1]) / 2 for x, y in pairs) / len(pairs)
    assert metrics["val/maj@2"] == pytest.approx(want)


def test_the_vote_compares_extracted_answers_not_texts():
    extras = [{"math_dapo": {"pred": "42"}}, {}, {"f": {"status": "ok"}, "g": {"answer": 7}}]
    assert vote_keys([" the answer is 42 ", " 42 ", "seven"], extras, ["x", None, "y"]) == ["42", "42", "7"]
    assert vote_keys(["  hi  "], [{}]) == ["hi"]
    manager = RewardManager([{"name": "numeric_match"}])
    assert manager.extracted_answers(["so 3.50", "=> 3.5", "1,000 apples", "none"]) == ["3.5", "3.5", "1000", None]
    exact = RewardManager([{"name": "exact_match", "kwargs": {"case_sensitive": False}}])
    assert exact.extracted_answers([" Paris "]) == ["paris"]

    # "1+1 = 2" and "two is 2" differ as text but both answer 2: with the extractor the vote is 2:2 -> "2" wins
    rows = [{"prompt": "p", "data_source": "d"}]

    def answer(chunk):
        return Answers(torch.tensor([1.0, 1.0, 0.0, 0.0]), ["1+1 = 2", "two is 2", "3", "3"])

    plain = evaluate_rows(rows, answer, n=4, ks=[4], chunk_size=8, dp_rank=0, dp_size=1, all_reduce_sum=lambda t: t)
    voted = evaluate_rows(rows, answer, n=4, ks=[4], chunk_size=8, dp_rank=0, dp_size=1, all_reduce_sum=lambda t: t,
                          extract_answers=lambda responses, sources: manager.extracted_answers(responses, sources))
    assert plain["val/maj@4"] == 0.0  # as texts, "3" has the most votes
    assert voted["val/maj@4"] == 0.5  # as answers, 2 and 3 tie


def test_k_larger_than_n_is_refused_before_sampling():
    called = []
    with pytest.raises(ConfigError, match=r"rollout.val_k=\[2, 8\]: pass@k, maj@k and mean@k for k=\[8\] need at "
                       r"least 8 answers per prompt, and rollout.val_n=4 samples 4. Fix: raise rollout.val_n to 8"):
        evaluate_rows(scripted_rows(), lambda chunk: called.append(chunk), n=4, ks=[2, 8], chunk_size=2, dp_rank=0,
                      dp_size=1, all_reduce_sum=lambda t: t)
    assert not called


def test_progress_reports_the_rows_answered():
    done: list[int] = []
    run(scripted_rows(), [1], progress=done.append)
    assert done == [2, 4, 5]


def test_ranks_answering_shares_reduce_to_the_one_rank_numbers():
    """Two data-parallel ranks (simulated: the reduction is a sum) each answer their share; the reduced
    metric@k, per source too, equal one rank answering every row."""
    rows = scripted_rows()
    whole = run(rows, [1, 2, 3])
    sums = []
    for rank in range(2):
        evaluate_rows(rows, scripted_answer, n=4, ks=[1, 2, 3], chunk_size=2, dp_rank=rank, dp_size=2,
                      all_reduce_sum=lambda t: sums.append(t) or t)
    reduced = evaluate_rows(rows, scripted_answer, n=4, ks=[1, 2, 3], chunk_size=2, dp_rank=0, dp_size=2,
                            all_reduce_sum=lambda t: sums[0] + sums[1])
    assert reduced == pytest.approx(whole, abs=1e-12) and set(reduced) == set(whole)


def test_bad_k_values_and_misplaced_keys_are_explained():
    from verl.config import load_config
    from verl.errors import RewardError
    from verl.trainer.rl.evaluation import check_ks

    with pytest.raises(ConfigError, match=r"rollout.val_k=\[0, 2\]: \[0\] must be positive"):
        check_ks(4, [0, 2])
    with pytest.raises(ConfigError, match=r"trainer.val_k: unknown key .* It is rollout.val_k here"):
        load_config(overrides=["trainer.val_k=[1,4]"])

    def mine(prompt, response, ground_truth, **metadata):
        return 1.0

    mine.extract_answer = lambda response, **kwargs: 1 / 0
    with pytest.raises(RewardError, match=r"its extract_answer raised ZeroDivisionError: .* remove its "
                       "extract_answer attribute to vote on the text"):
        RewardManager([mine]).extracted_answers(["x"])
