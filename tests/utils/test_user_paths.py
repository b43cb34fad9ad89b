"""The one rule for a relative path a user wrote (data files, reward and environment files): looked up in
the working directory and the config file's folder, found in exactly one; else an error naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl.config import load_config
from verl.errors import DataError, RewardError
from verl.rewards import RewardManager
from verl.utils.user_code import resolve_user_path


def _fail(msg: str) -> DataError:
    return DataError(msg)


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """(working directory, config folder), two different folders."""
    cwd, cfg = tmp_path / "here", tmp_path / "configs"
    cwd.mkdir()
    cfg.mkdir()
    monkeypatch.chdir(cwd)
    return cwd, cfg


def test_found_in_one_place_either_one(dirs):
    cwd, cfg = dirs
    (cwd / "a.jsonl").write_text("{}\n")
    (cfg / "b.jsonl").write_text("{}\n")
    assert resolve_user_path("a.jsonl", cfg, what="data file", fail=_fail) == (cwd / "a.jsonl").resolve()
    assert resolve_user_path("b.jsonl", cfg, what="data file", fail=_fail) == (cfg / "b.jsonl").resolve()
    assert resolve_user_path("a.jsonl", None, what="data file", fail=_fail) == (cwd / "a.jsonl").resolve()
    with pytest.raises(DataError, match=r"b.jsonl does not exist: tried .*here/b.jsonl \(the working directory\)\."):
        resolve_user_path("b.jsonl", None, what="data file", fail=_fail)  # no config: the working directory only


def test_missing_and_ambiguous_name_both_places_tried(dirs):
    cwd, cfg = dirs
    with pytest.raises(DataError) as missing:
        resolve_user_path("x.jsonl", cfg, what="data file", fail=_fail)
    assert (f"data file x.jsonl does not exist: tried {cwd / 'x.jsonl'} (the working directory) and "
            f"{cfg / 'x.jsonl'} (the config file's folder)") in str(missing.value)
    (cwd / "x.jsonl").write_text("{}\n")
    (cfg / "x.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match=r"x.jsonl is ambiguous: both .*here/x.jsonl \(the working directory\) and "
                                        r".*configs/x.jsonl \(the config file's folder\) exist.*absolute path"):
        resolve_user_path("x.jsonl", cfg, what="data file", fail=_fail)
    # the same file from both places (the run starts in the config's folder) is not ambiguous
    assert resolve_user_path("x.jsonl", cwd, what="data file", fail=_fail) == (cwd / "x.jsonl").resolve()


def test_data_files_and_reward_files_follow_the_same_rule(dirs):
    cwd, cfg = dirs
    (cfg / "run.yaml").write_text("data:\n  train_files: [train.jsonl]\n")
    (cfg / "train.jsonl").write_text("{}\n")
    (cwd / "score.py").write_text("def fn(prompt, response, ground_truth):\n    return 1.0\n")
    config = load_config(cfg / "run.yaml")
    assert config.resolve_path("train.jsonl") == str((cfg / "train.jsonl").resolve())
    # a reward file next to the user (typed on the command line) is found as the data next to the config is
    assert RewardManager([{"name": "score.py:fn"}], base_dir=config._source_dir).score(["p"], ["r"], ["g"]).scores == 1
    (cfg / "score.py").write_text("def fn(prompt, response, ground_truth):\n    return 0.0\n")
    with pytest.raises(RewardError, match=r"reward file score.py is ambiguous"):
        RewardManager([{"name": "score.py:fn"}], base_dir=config._source_dir)
