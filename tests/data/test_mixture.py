"""data.mixture: sources drawn with exact per-epoch shares in a seeded order that resumes exactly, every row
tagged with its source, and weights that cannot work refused in the config."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from verl.config.loader import build_config
from verl.data.mixture import MixtureRows
from verl.data.sampler import MixtureOrder, order_for, quotas
from verl.data.split import split_train_val
from verl.env import DatasetEnv
from verl.errors import CheckpointError, ConfigError, DataError
from verl.rewards import RewardManager


def _jsonl(path: Path, n: int, tag: str) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{tag}{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return path


def test_quotas_are_the_weights_shares_summing_to_the_epoch() -> None:
    assert quotas([0.7, 0.3], 10) == [7, 3]
    assert quotas([1, 1, 1], 10) == [4, 3, 3]  # largest remainder, ties to the earlier source
    assert quotas([2, 0, 1], 7) == [5, 0, 2] and sum(quotas([0.15, 0.85], 13)) == 13


def test_every_epoch_holds_each_source_share_exactly() -> None:
    order = MixtureOrder([6, 30], [0.5, 0.5], seed=3, names=["small", "big"])
    assert order.num_rows == 36 and order.quotas == [18, 18]
    for epoch in range(3):
        idx = order.take(36)
        sources = Counter(order.source_of(i) for i in idx)
        assert sources == {0: 18, 1: 18} and order.epoch == epoch
        small = Counter(i for i in idx if i < 6)
        assert set(small.values()) == {3}  # the small source cycles: each of its rows 3 times an epoch
    big_seen = [i for i in MixtureOrder([6, 30], [0.5, 0.5], seed=3).take(72) if i >= 6]
    assert sorted(big_seen[:30]) == list(range(6, 36))  # the big source: every row once before any repeats


def test_the_order_is_seeded_and_resumes_exactly() -> None:
    def make(seed: int = 1) -> MixtureOrder:
        return MixtureOrder([5, 9, 4], [0.2, 0.5, 0.3], seed=seed, names=["a", "b", "c"], what="environment")

    straight = make()
    first = straight.take(7) + straight.take(11) + straight.take(13)
    assert first == (lambda o: o.take(31))(make()) and first != make(2).take(31)
    resumed = make()
    resumed.take(18)
    state = resumed.state_dict()
    again = make()
    again.load_state_dict(state)
    assert again.take(13) == first[18:] and again.state_dict() == straight.state_dict()
    other = MixtureOrder([5, 9, 4], [0.3, 0.5, 0.2], seed=1, names=["a", "b", "c"], what="environment")
    with pytest.raises(CheckpointError, match=r"environment state does not match this run \(weights: checkpoint "
                                              r"\[0.2, 0.5, 0.3\] vs now \[0.3, 0.5, 0.2\]\)"):
        other.load_state_dict(state)
    plain = order_for(list(range(18)), seed=1)
    with pytest.raises(CheckpointError, match=r"sampler state was written by a run with data.mixture \(a, b, c\)"):
        plain.load_state_dict(state)
    with pytest.raises(CheckpointError, match="written by a run without data.mixture"):
        make().load_state_dict(plain.state_dict())


def test_without_shuffle_the_sources_interleave_evenly() -> None:
    order = MixtureOrder([4, 8], [1, 3], seed=0, shuffle=False)
    assert order.quotas == [3, 9]
    assert [order.source_of(i) for i in order.take(12)] == [1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1]


def test_weights_that_cannot_work_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data.mixture.1.weight: Value error, the weight is -0.5; a mixture "
                                          r"weight is a relative share, a number >= 0"):
        build_config({"data": {"mixture": [{"files": ["a.jsonl"]}, {"files": ["b.jsonl"], "weight": -0.5}]}})
    with pytest.raises(ConfigError, match=r"data.mixture weights sum to 0 \(a: 0.0, b: 0.0\); give at least one "
                                          r"source a weight > 0"):
        build_config({"data": {"mixture": [{"files": ["x/a.jsonl"], "weight": 0},
                                           {"files": ["b.parquet"], "weight": 0}]}})
    with pytest.raises(ConfigError, match=r"data.mixture and data.train_files \(t.jsonl\) are both set"):
        build_config({"data": {"train_files": "t.jsonl", "mixture": [{"files": "a.jsonl"}]}})
    with pytest.raises(ConfigError, match=r"data.mixture names math more than one source"):
        build_config({"data": {"mixture": [{"name": "math", "files": "a.jsonl"},
                                           {"name": "math", "files": "b.jsonl"}]}})
    with pytest.raises(ConfigError, match=r"a mixture source needs files"):
        build_config({"data": {"mixture": [{"name": "math"}]}})
    with pytest.raises(ConfigError, match=r"weights \[1.0, nan\]: each must be a number >= 0"):
        MixtureOrder([1, 1], [1.0, float("nan")], seed=0)
    with pytest.raises(DataError, match=r"mixture source\(s\) b have no rows but a weight > 0"):
        MixtureOrder([3, 0], [1, 1], seed=0, names=["a", "b"])


def test_rows_are_tagged_and_held_out_per_source(tmp_path: Path) -> None:
    config = build_config({"data": {"val_size": 3, "mixture": [
        {"files": [str(_jsonl(tmp_path / "math.jsonl", 6, "m"))], "weight": 0.7},
        {"name": "code", "files": [str(_jsonl(tmp_path / "c.jsonl", 4, "c"))], "weight": 0.3}]}})
    split = split_train_val(config, "prompt")
    train, val = split.rows()
    assert sorted(split.reports) == ["train (mixture code)", "train (mixture math)"]
    assert isinstance(train, MixtureRows) and (len(train), len(val)) == (7, 3)
    assert train.mixture.names == ["math", "code"] and sum(train.mixture.sizes) == 7
    tags = {r["prompt"][0]: r["mixture"] for r in [*train, *val]}
    assert tags == {"m": "math", "c": "code"}
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in val)


def test_the_environment_draws_the_mixture_and_resumes(tmp_path: Path) -> None:
    config = build_config({"data": {"mixture": [
        {"name": "math", "files": [str(_jsonl(tmp_path / "m.jsonl", 20, "m"))], "weight": 3},
        {"name": "code", "files": [str(_jsonl(tmp_path / "c.jsonl", 5, "c"))], "weight": 1}]}})
    train, _ = split_train_val(config, "prompt").rows()
    manager = RewardManager([{"name": "exact_match"}])
    env = DatasetEnv(train, manager, seed=7)
    assert env.metric_sources == ("mixture", ["math", "code"])
    epoch = [r["mixture"] for _ in range(5) for r in env.get_batch(5)]
    assert Counter(epoch) == {"math": 19, "code": 6}  # 25 slots at 3:1, by largest remainder
    state = env.state_dict()
    later = [r["prompt"] for r in env.get_batch(9)]
    again = DatasetEnv(train, manager, seed=7)
    again.load_state_dict(state)
    assert [r["prompt"] for r in again.get_batch(9)] == later


def test_the_offline_trainers_refuse_a_mixture(tmp_path: Path) -> None:
    config = build_config({"data": {"mixture": [{"files": [str(_jsonl(tmp_path / "a.jsonl", 3, "a"))]}]}})
    with pytest.raises(ConfigError, match=r"data.mixture weights the prompts RL draws; the sft trainer reads every row "
                                          r"each epoch, so the weights would be ignored. Fix: list the files in "
                                          r"data.train_files \(.*a.jsonl\)"):
        split_train_val(config, "sft").rows()
