"""RewardManager: loading, weighted sums, routing by data_source, batched functions and every error path."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from verl.errors import ConfigError, RewardError
from verl.rewards import RewardFunctionSpec, RewardManager

USER_CODE = """
import math

calls = []

def length_bonus(prompt, response, ground_truth, **metadata):
    calls.append(dict(metadata))
    return {"score": len(response) / 10.0, "chars": float(len(response)), "correct": float(response == ground_truth)}

def named_only(prompt, response, ground_truth, difficulty=0.0):
    return float(difficulty)

def by_source(prompt, response, ground_truth, data_source=None):
    return 1.0 if data_source == "b" else 0.0

def returns_none(prompt, response, ground_truth, **kw):
    if response == "ok":
        return 1.0

def returns_nan(prompt, response, ground_truth, **kw):
    return math.nan if response == "bad" else 0.5

def returns_inf(prompt, response, ground_truth, **kw):
    return float("inf")

def returns_text(prompt, response, ground_truth, **kw):
    return "1.0"

def dict_without_score(prompt, response, ground_truth, **kw):
    return {"reward": 1.0}

def dapo_like(prompt, response, ground_truth, **kw):  # verl's math_dapo: score, acc and the parsed answer
    return {"score": 1.0 if response == "19" else -1.0, "acc": response == "19", "pred": response or None,
            "steps": [1, 2], "ratio": float("nan")}

def divide(prompt, response, ground_truth, **kw):
    return 1 / int(response)

def batch_len(prompts, responses, ground_truths, metadatas, scale=1.0):
    batch_len.calls += 1
    batch_len.seen = list(responses)
    return [scale * len(r) for r in responses]
batch_len.calls = 0

def batch_short(prompts, responses, ground_truths, metadatas):
    return [1.0] * (len(responses) - 1)

def batch_tensor(prompts, responses, ground_truths, metadatas):
    import torch
    return torch.arange(len(responses), dtype=torch.float64)

def batch_raises(prompts, responses, ground_truths, metadatas):
    raise KeyError("label")

def two_args(prompt, response):
    return 1.0

not_a_function = 3
"""


@pytest.fixture()
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_CODE)
    return path


def _mgr(user_file: Path, *specs: dict) -> RewardManager:
    return RewardManager(list(specs), base_dir=user_file.parent)


def test_weighted_sum_matches_float64_reference(user_file: Path) -> None:
    mgr = _mgr(
        user_file,
        {"name": "numeric_match", "weight": 0.7},
        {"name": "format", "weight": -0.3, "kwargs": {"pattern": r"^\d+$"}},
        {"name": "my_reward.py:length_bonus", "weight": 0.25},
    )
    responses = ["19", "x 19", "7", "seven"]
    gts = ["19", "19", "8", "7"]
    res = mgr.score(["p"] * 4, responses, gts, [{}] * 4, [None] * 4)
    num = [1.0, 1.0, 0.0, 0.0]
    fmt = [1.0, 0.0, 1.0, 0.0]
    length = [len(r) / 10.0 for r in responses]
    want = [math.fsum([0.7 * a, -0.3 * b, 0.25 * c]) for a, b, c in zip(num, fmt, length, strict=True)]
    assert res.scores.dtype == torch.float32 and res.scores.shape == (4,)
    torch.testing.assert_close(res.scores, torch.tensor(want, dtype=torch.float64).float())
    assert mgr.names == ["numeric_match", "format", "length_bonus"]
    torch.testing.assert_close(res.per_function["format"], torch.tensor(fmt))
    assert res.metrics["reward/length_bonus/chars"] == pytest.approx(np.mean([len(r) for r in responses]))
    assert res.metrics["reward/length_bonus/correct"] == pytest.approx(0.25)  # only "19" == "19"
    assert res.metrics["reward/numeric_match/score"] == pytest.approx(0.5)
    assert res.metrics["reward/mean"] == pytest.approx(math.fsum(want) / 4)


def test_data_sources_route_functions(user_file: Path) -> None:
    mgr = _mgr(
        user_file,
        {"name": "exact_match", "data_sources": ["a"]},
        {"name": "numeric_match", "data_sources": ["b", "c"], "weight": 2.0},
    )
    res = mgr.score(["p"] * 3, ["x", "5", "5"], ["x", "5", "6"], None, ["a", "b", "c"])
    assert res.scores.tolist() == [1.0, 2.0, 0.0]
    assert res.applied["exact_match"].tolist() == [True, False, False]
    assert res.applied["numeric_match"].tolist() == [False, True, True]
    assert res.per_function["exact_match"].tolist() == [1.0, 0.0, 0.0]
    assert res.metrics["reward/numeric_match/score"] == pytest.approx(0.5)  # mean over applied samples only


def test_unknown_data_source_is_an_error_not_zero() -> None:
    mgr = RewardManager(
        [
            {"name": "numeric_match", "data_sources": ["gsm8k"]},
            {"name": "exact_match", "data_sources": ["math"]},
        ]
    )
    with pytest.raises(RewardError) as e:
        mgr.score(["p"] * 3, ["1", "1", "1"], ["1", "1", "1"], None, ["gsm8k", "gsm8kk", None])
    msg = str(e.value)
    assert "data_source 'gsm8kk' (sample 1)" in msg
    assert "no data_source (sample 2)" in msg
    assert "['gsm8k', 'math']" in msg and "never scored 0 silently" in msg


def test_unrestricted_function_covers_every_data_source() -> None:
    mgr = RewardManager([{"name": "numeric_match", "data_sources": ["gsm8k"]}, {"name": "exact_match"}])
    assert mgr.known_data_sources is None
    res = mgr.score(["p"] * 2, ["1", "1"], ["1", "1"], None, ["gsm8k", "other"])
    assert res.scores.tolist() == [2.0, 1.0]


def test_metadata_is_passed_filtered_and_data_source_injected(user_file: Path) -> None:
    mgr = _mgr(
        user_file,
        {"name": "my_reward.py:length_bonus", "weight": 0.0},
        {"name": "my_reward.py:named_only"},
        {"name": "my_reward.py:by_source"},
    )
    meta = [{"difficulty": 2.5, "split": "train"}, {"difficulty": 1.0}]
    res = mgr.score(["p", "p"], ["ab", "c"], ["g", "g"], meta, ["a", "b"])
    # named_only has no **kwargs: it gets difficulty but not split (which would be a TypeError).
    assert res.per_function["named_only"].tolist() == [2.5, 1.0]
    assert res.per_function["by_source"].tolist() == [0.0, 1.0]
    mod = sys.modules[
        next(
            n
            for n in sys.modules
            if n.startswith("verl_user_reward_")
            and getattr(sys.modules[n], "__file__", "") == str(user_file.resolve())
        )
    ]
    assert mod.calls[-2:] == meta  # **kwargs functions see every metadata key


def test_module_path_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "acme_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def half(prompt, response, ground_truth, **kw):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mgr = RewardManager([{"name": "acme_rewards_pkg.scoring:half", "weight": 3.0}])
    assert mgr.score(["p"], ["r"], ["g"]).scores.tolist() == [1.5]


def test_batched_function_called_once_on_applicable_subset(user_file: Path) -> None:
    mgr = _mgr(
        user_file,
        {"name": "my_reward.py:batch_len", "batched": True, "data_sources": ["a"], "kwargs": {"scale": 0.5}},
        {"name": "my_reward.py:batch_tensor", "batched": True, "data_sources": ["b"]},
    )
    res = mgr.score(["p"] * 4, ["aaaa", "bb", "cc", "dddddd"], [None] * 4, None, ["a", "b", "b", "a"])
    fn = next(ld.fn for ld in mgr._loaded if ld.label == "batch_len")
    assert fn.calls == 1 and fn.seen == ["aaaa", "dddddd"]
    assert res.scores.tolist() == [2.0, 0.0, 1.0, 3.0]


# ---- error paths ---------------------------------------------------------------------------------


def test_function_that_raises_names_function_index_and_source(user_file: Path) -> None:
    mgr = _mgr(user_file, {"name": "my_reward.py:divide"})
    with pytest.raises(RewardError) as e:
        mgr.score(["p"] * 3, ["1", "2", "0"], ["g"] * 3, None, ["s1", "s2", "s3"])
    msg = str(e.value)
    assert "reward function 'divide'" in msg and "reward.functions[0]" in msg
    assert "ZeroDivisionError" in msg and "on sample 2" in msg and "data_source='s3'" in msg
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_builtin_error_is_wrapped_with_index() -> None:
    mgr = RewardManager([{"name": "numeric_match"}])
    with pytest.raises(RewardError, match=r"'numeric_match'.*ground_truth is None.*on sample 1"):
        mgr.score(["p", "p"], ["1", "2"], ["1", None])


@pytest.mark.parametrize(
    ("fn", "responses", "pattern"),
    [
        (
            "returns_none",
            ["ok", "no"],
            r"'returns_none'.*on sample 1.*returned None.*missing return gives None",
        ),
        (
            "returns_nan",
            ["fine", "bad"],
            r"'returns_nan'.*on sample 1.*returned nan; a reward must be finite",
        ),
        ("returns_inf", ["x"], r"'returns_inf'.*on sample 0.*returned inf"),
        ("returns_text", ["x"], r"'returns_text'.*returned '1.0' \(str\)"),
        ("dict_without_score", ["x"], r"dict without a 'score' key \(keys: \['reward'\]\)"),
    ],
)
def test_unusable_return_values(user_file: Path, fn: str, responses: list[str], pattern: str) -> None:
    mgr = _mgr(user_file, {"name": f"my_reward.py:{fn}"})
    n = len(responses)
    with pytest.raises(RewardError, match=pattern):
        mgr.score(["p"] * n, responses, ["g"] * n)


def test_batched_function_configured_per_sample_gets_a_hint(user_file: Path) -> None:
    mgr = _mgr(user_file, {"name": "my_reward.py:batch_len"})
    with pytest.raises(RewardError, match=r"'batch_len'.*TypeError.*on sample 0.*set batched: true"):
        mgr.score(["p"], ["r"], ["g"])


def test_missing_required_metadata_names_sample(user_file: Path) -> None:
    (user_file.parent / "needs.py").write_text(
        "def needs(prompt, response, ground_truth, level):\n    return 1.0\n"
    )
    mgr = _mgr(user_file, {"name": "needs.py:needs"})
    assert mgr.score(["p"], ["r"], ["g"], [{"level": 1}]).scores.tolist() == [1.0]
    with pytest.raises(
        RewardError, match=r"'needs'.*missing 1 required positional argument: 'level'.*on sample 1"
    ):
        mgr.score(["p", "p"], ["r", "r"], ["g", "g"], [{"level": 1}, {}])


def test_batched_error_paths(user_file: Path) -> None:
    short = _mgr(user_file, {"name": "my_reward.py:batch_short", "batched": True})
    with pytest.raises(RewardError, match=r"'batch_short'.*returned 2 results for 3 samples"):
        short.score(["p"] * 3, ["a", "b", "c"], [None] * 3)
    raising = _mgr(user_file, {"name": "my_reward.py:batch_raises", "batched": True})
    with pytest.raises(
        RewardError, match=r"batched reward function 'batch_raises'.*KeyError.*samples 0..1"
    ) as e:
        raising.score(["p"] * 2, ["a", "b"], [None] * 2)
    assert isinstance(e.value.__cause__, KeyError)


@pytest.mark.parametrize(
    ("spec", "exc", "pattern"),
    [
        (
            {"name": "exact_mtch"},
            RewardError,
            r"'exact_mtch' is not a built-in reward. Did you mean 'exact_match'",
        ),
        (
            {"name": "missing.py:fn"},
            RewardError,
            r"reward.functions\[0\].*missing.py does not exist: tried .*working directory.*config file's folder",
        ),
        (
            {"name": "my_reward.py:lenght_bonus"},
            RewardError,
            r"has no function 'lenght_bonus'. Did you mean 'length_bonus'",
        ),
        ({"name": "my_reward.py:not_a_function"}, RewardError, r"is a int, not a function"),
        ({"name": "no_such_pkg_xyz.mod:fn"}, RewardError, r"module 'no_such_pkg_xyz.mod' cannot be imported"),
        (
            {"name": "my_reward.py:"},
            RewardError,
            r"must have a file or module before ':' and a function name",
        ),
        (
            {"name": "my_reward.py:two_args"},
            RewardError,
            r"'two_args\(prompt, response\)' cannot be called as fn\(prompt",
        ),
        (
            {"name": "my_reward.py:two_args", "batched": True},
            RewardError,
            r"cannot be called as fn\(prompts, responses",
        ),
        ({"name": "my_reward.py:named_only", "kwargs": {"bogus": 1}}, RewardError, r"kwargs \['bogus'\]"),
        ({"name": "format"}, RewardError, r"format reward needs kwargs.pattern"),
        ({"name": "format", "kwargs": {"pattern": "("}}, RewardError, r"not a valid regular expression"),
        ({"name": "numeric_match", "kwargs": {"mode": "loose"}}, RewardError, r"kwargs.mode must be"),
        ({"name": "numeric_match", "wieght": 2}, ConfigError, r"reward.functions\[0\].wieght: Extra inputs"),
        ({"name": "numeric_match", "weight": float("nan")}, ConfigError, r"weight must be a finite number"),
        ({"name": "numeric_match", "data_sources": []}, ConfigError, r"empty list"),
    ],
)
def test_bad_specs_fail_at_construction(user_file: Path, spec: dict, exc: type, pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        RewardManager([spec], base_dir=user_file.parent)


def test_file_that_fails_to_import(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import nope_not_a_module_abc\n")
    with pytest.raises(RewardError, match=r"importing reward file .*broken.py raised ModuleNotFoundError"):
        RewardManager([{"name": "broken.py:fn"}], base_dir=tmp_path)


def test_empty_and_malformed_spec_lists() -> None:
    with pytest.raises(ConfigError, match="reward.functions is empty"):
        RewardManager([])
    with pytest.raises(ConfigError, match="must be a list of specs"):
        RewardManager({"name": "exact_match"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"reward.functions\[0\] is a str"):
        RewardManager(["exact_match"])  # type: ignore[list-item]


def test_input_length_mismatch() -> None:
    mgr = RewardManager([RewardFunctionSpec(name="exact_match")])
    with pytest.raises(RewardError, match="lists of different lengths"):
        mgr.score(["p"], ["a", "b"], ["a", "b"])


def test_duplicate_names_get_distinct_labels() -> None:
    mgr = RewardManager(
        [{"name": "format", "kwargs": {"pattern": "a"}}, {"name": "format", "kwargs": {"pattern": "b"}}]
    )
    assert mgr.names == ["format", "format_2"]
    res = mgr.score(["p"], ["a"], [None])
    assert res.per_function["format"].tolist() == [1.0] and res.per_function["format_2"].tolist() == [0.0]


def test_spec_defaults() -> None:
    spec = RewardFunctionSpec(name=" numeric_match ")
    assert (spec.name, spec.weight, spec.kwargs, spec.data_sources, spec.batched) == (
        "numeric_match",
        1.0,
        {},
        None,
        False,
    )


VERL_STYLE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """volcengine/verl's signature: the data_source comes first."""
    if data_source != "openai/gsm8k":
        raise NotImplementedError(data_source)
    bonus = 0.5 if extra_info and extra_info.get("split") == "train" else 0.0
    return float(solution_str.strip() == ground_truth) + bonus


def compute_score_batched(data_sources, solution_strs, ground_truths, extra_infos):
    return [{"score": float(s == g), "source_ok": float(d == "openai/gsm8k" and e["index"] >= 0)}
            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]
'''


def test_a_volcengine_verl_compute_score_is_called_with_its_data_source_first(tmp_path: Path) -> None:
    (tmp_path / "verl_reward.py").write_text(VERL_STYLE)
    mgr = RewardManager([{"name": "verl_reward.py:compute_score"},
                         {"name": "verl_reward.py:compute_score_batched", "batched": True}], base_dir=tmp_path)
    assert mgr.described == ["compute_score (volcengine/verl's convention)",
                             "compute_score_batched (volcengine/verl's convention)"]  # what `verl check` prints
    metadata = [{"extra_info": {"split": "train", "index": 0}}, {"extra_info": {"split": "test", "index": 1}}]
    result = mgr.score(["Q: 6*7?", "Q: 1+1?"], [" 42", "3"], ["42", "2"], metadata=metadata,
                       data_sources=["openai/gsm8k", "openai/gsm8k"])
    assert result.per_function["compute_score"].tolist() == [1.5, 0.0]  # not called with the prompt first
    assert result.per_function["compute_score_batched"].tolist() == [0.0, 0.0]  # " 42" != "42" unstripped
    assert result.metrics["reward/compute_score_batched/source_ok"] == 1.0


TRL_STYLE = '''
def reward_len(completions, **kwargs):
    return [-abs(3 - len(c)) for c in completions]


def accuracy(completions, solution, **kwargs):  # TRL's GSM8K recipe names the ground truth `solution`
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def only_math(completions, data_source, difficulty):  # None: does not apply to that sample
    return [len(c) / 10 if d == "math" else None for c, d in zip(completions, data_source)]


def chat_format(prompts, completions, **kwargs):
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant") for p, c in zip(prompts, completions)]
'''


def _trl_manager(tmp_path: Path, *names: str) -> RewardManager:
    (tmp_path / "trl_reward.py").write_text(TRL_STYLE)
    return RewardManager([{"name": f"trl_reward.py:{n}"} for n in names], base_dir=tmp_path)


def test_a_trl_reward_function_gets_keywords_and_columns_in_one_call(tmp_path: Path) -> None:
    mgr = _trl_manager(tmp_path, "reward_len", "accuracy", "only_math")
    assert mgr.described[0] == "reward_len (TRL's convention)"
    result = mgr.score(["1+1=", "2+2=", "say hi"], ["2", " 5", "hello"], ["2", "4", None],
                       metadata=[{"difficulty": 1}, {"difficulty": 2}, {"difficulty": 0}],
                       data_sources=["math", "math", "chat"])
    assert result.per_function["reward_len"].tolist() == [-2.0, -1.0, -2.0]
    assert result.per_function["accuracy"].tolist() == [1.0, 0.0, 0.0]
    assert result.applied["only_math"].tolist() == [True, True, False]  # None: not applied, as in TRL
    assert result.per_function["only_math"].tolist() == pytest.approx([0.1, 0.2, 0.0])
    assert result.scores.tolist() == pytest.approx([-0.9, -0.8, -2.0])


def test_a_trl_reward_function_sees_chat_completions_for_chat_prompts(tmp_path: Path) -> None:
    mgr = _trl_manager(tmp_path, "chat_format")
    result = mgr.score([[{"role": "user", "content": "hi"}]], ["hello"], [None])
    assert result.scores.tolist() == [1.0]


def test_a_trl_function_missing_a_column_or_scoring_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RewardError, match=r"TRL-style function .* needs \['difficulty'\], which the rows do not have"):
        _trl_manager(tmp_path, "only_math").score(["q"], ["a"], [None], data_sources=["math"])
    with pytest.raises(RewardError, match=r"no reward function scored sample 0 \(data_source='chat'\)"):
        _trl_manager(tmp_path, "only_math").score(["q"], ["a"], [None], metadata=[{"difficulty": 0}],
                                                  data_sources=["chat"])


def test_a_trl_function_gets_the_ground_truth_under_every_name_the_data_layer_reads_it_from() -> None:
    from verl.data.fields import SPECS
    from verl.rewards.manager import GROUND_TRUTH_NAMES

    assert GROUND_TRUTH_NAMES == SPECS["prompt"].aliases["ground_truth"]


def test_our_batched_convention_stays_ours_whatever_its_parameters_are_called(tmp_path: Path) -> None:
    (tmp_path / "ours.py").write_text("def fn(prompts, completions, ground_truths, metadatas):\n"
                                      "    return [float(c == g) for c, g in zip(completions, ground_truths)]\n")
    mgr = RewardManager([{"name": "ours.py:fn", "batched": True}], base_dir=tmp_path)
    assert mgr.described == ["fn"]
    assert mgr.score(["q", "q"], ["1", "2"], ["1", "1"]).scores.tolist() == [1.0, 0.0]


def test_a_function_that_names_data_source_gets_it_beside_its_other_keywords() -> None:
    def by_source(prompt, response, ground_truth, data_source=None, **metadata):
        return {"gsm8k": 1.0, "math": 0.0}[data_source] + 0.5 * ("level" in metadata)

    mgr = RewardManager([by_source])
    result = mgr.score(["a", "b"], ["1", "2"], ["1", "2"], metadata=[{}, {"level": 3}], data_sources=["gsm8k", "math"])
    assert result.scores.tolist() == [1.0, 0.5]


def test_a_trl_function_gets_trainer_state_and_log_metric_as_trl_gives_them() -> None:
    """TRL passes `trainer_state` (curriculum by step), `log_metric` and `log_extra` to every reward function."""
    from verl.rewards import TrainingProgress

    seen = []

    def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        log_metric("mean_length", sum(map(len, completions)) / len(completions))
        log_extra("note", ["x"] * len(completions))
        return [min(trainer_state.global_step / trainer_state.max_steps, 1.0)] * len(completions)

    mgr = RewardManager([curriculum])
    mgr.progress = TrainingProgress(global_step=5, max_steps=10)
    result = mgr.score(["a", "b"], ["12", "1234"], ["1", "2"])
    assert seen == [(5, 10)] and result.scores.tolist() == [0.5, 0.5]
    assert result.metrics["reward/curriculum/mean_length"] == 3.0

    def bad(completions, log_metric, **kwargs):
        log_metric("oops", "n/a")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="logged 'oops'.*finite number"):
        RewardManager([bad]).score(["a"], ["1"], ["1"])


def test_a_trl_function_gets_completion_ids_where_the_caller_passes_token_ids() -> None:
    def by_tokens(completions, completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    mgr = RewardManager([by_tokens])
    result = mgr.score(["a", "b"], ["x", "yz"], ["1", "2"], response_ids=[[5, 7, 2], [9]])
    assert result.scores.tolist() == [3.0, 1.0]
    with pytest.raises(RewardError, match=r"needs \['completion_ids'\]"):  # a caller with text only
        mgr.score(["a"], ["x"], ["1"])
    with pytest.raises(RewardError, match="different lengths"):
        mgr.score(["a"], ["x"], ["1"], response_ids=[[1], [2]])


def test_a_dict_with_non_numeric_extras_is_scored_numbers_to_metrics_the_rest_to_the_sample(user_file: Path) -> None:
    """verl's compute_score (math_dapo) returns {"score", "acc", "pred": text}: never refused; numbers are
    averaged into metrics, the rest kept per sample for samples.jsonl."""
    mgr = _mgr(user_file, {"name": "my_reward.py:dapo_like"})
    result = mgr.score(["p", "p"], ["19", ""], ["19", "19"])
    assert result.scores.tolist() == [1.0, -1.0]
    assert result.metrics["reward/dapo_like/acc"] == 0.5 and result.metrics["reward/dapo_like/score"] == 0.0
    assert not any(k.endswith(("/pred", "/steps", "/ratio")) for k in result.metrics)
    assert result.extras[0] == {"dapo_like": {"pred": "19", "steps": [1, 2], "ratio": result.extras[0][
        "dapo_like"]["ratio"]}}
    assert result.extras[1]["dapo_like"]["pred"] is None and math.isnan(result.extras[1]["dapo_like"]["ratio"])


def test_reward_extras_reach_samples_jsonl(tmp_path: Path) -> None:
    from verl.tracking.tracker import Tracker

    tracker = Tracker(["jsonl"], tmp_path)
    tracker.log_samples([{"prompt": "p", "response": "19", "score": 1.0, "reward_extras": {"f": {"pred": "19"}}},
                         {"prompt": "q", "response": "2", "score": 0.0}], step=3)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["reward_extras"] == {"f": {"pred": "19"}} and "reward_extras" not in rows[1]


def test_a_raising_function_shows_the_users_own_file_line_and_text(tmp_path: Path) -> None:
    """The message names the user's line (the innermost frame in their code, through a helper of theirs),
    not verl's call stack, so a printed VerlError replaces the traceback."""
    (tmp_path / "helpers.py").write_text("def parse(text):\n    return int(text.split('####')[1])\n")
    (tmp_path / "scorer.py").write_text(
        "import sys\nsys.path.insert(0, __import__('os').path.dirname(__file__))\nfrom helpers import parse\n\n"
        "def score(prompt, response, ground_truth):\n    return float(parse(response) == int(ground_truth))\n\n"
        "def score_all(prompts, responses, ground_truths, metadatas):\n    return [len(r) / 0 for r in responses]\n")
    mgr = RewardManager([{"name": "scorer.py:score"}], base_dir=tmp_path)
    with pytest.raises(RewardError) as e:
        mgr.score(["p"], ["no answer"], ["3"])
    msg = str(e.value)
    assert f'at File "{tmp_path / "helpers.py"}", line 2, in parse: return int(text.split(\'####\')[1])' in msg
    assert "IndexError" in msg and "manager.py" not in msg
    batched = RewardManager([{"name": "scorer.py:score_all", "batched": True}], base_dir=tmp_path)
    with pytest.raises(RewardError, match=r'scorer.py", line 9, in (<listcomp>|score_all): return \[len\(r\) / 0'):
        batched.score(["p"], ["x"], ["3"])


def test_accuracy_is_the_weighted_acc_extra_and_nan_where_no_function_gives_one() -> None:
    """`RewardResult.accuracy` is what DAPO's dynamic sampling filters on: the `acc` of dict returns."""

    def graded(prompt, response, ground_truth, **meta):
        return {"score": 0.5, "acc": float(response == "right")} if response != "plain" else 0.25

    def styled(prompt, response, ground_truth, **meta):
        return {"score": 0.1, "acc": 1.0, "style": 0.3}

    mgr = RewardManager([graded, {"name": "exact_match", "weight": 2.0}])
    result = mgr.score(["p"] * 3, ["right", "wrong", "plain"], ["x"] * 3)
    assert result.accuracy[:2].tolist() == [1.0, 0.0] and math.isnan(float(result.accuracy[2]))
    both = RewardManager([graded, styled])
    assert both.score(["p"], ["right"], ["x"]).accuracy.tolist() == [2.0]
    assert RewardManager([{"name": "exact_match"}]).score(["p"], ["x"], ["x"]).accuracy is None
