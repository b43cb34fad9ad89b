"""DAPO dynamic sampling (`algorithm.filter_groups`): the batch is filled with groups whose rewards differ,
drawing more prompts for at most `algorithm.max_resample_rounds` rounds; rows, prompts, responses and
scores stay aligned through the concatenation."""

from __future__ import annotations

import torch
from rl_support import rl_config

from verl.batch import varied_groups
from verl.trainer.rl_trainer import RLTrainer


def half_constant(prompt, response, ground_truth, **meta):
    """Equal rewards for prompts whose digits sum to an even number, varied ones (by response text) otherwise."""
    if sum(int(c) for c in str(prompt) if c.isdigit()) % 2 == 0:
        return 1.0
    return float(sum(map(ord, response)) % 5)


SPEC = {"name": f"{__file__}:half_constant"}


def _trainer(tmp_path, *overrides):
    return RLTrainer(rl_config(tmp_path, "trainer.total_steps=2", "algorithm.filter_groups=true",
                               "data.train_batch_size=8", "rollout.max_new_tokens=6", *overrides, reward=SPEC))


def _sampled(trainer):
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    metrics: dict[str, float] = {}
    return batch, trainer.filter_groups(batch, metrics), metrics


def _assert_aligned(trainer, out):
    n = trainer.config.rollout.n
    assert len(out) == 8 * n
    ids = out.group_ids.tolist()
    assert all(ids[i] == ids[i - i % n] for i in range(len(ids)))  # whole groups, contiguous
    assert len(set(ids)) == 8
    for i, row in enumerate(out.rows):  # each row's prompt tokens, response text and score belong together
        want_ids, want_mask = trainer.encode_prompts([row])
        got = out.prompt_ids[i][out.prompt_mask[i].bool()]
        assert torch.equal(got, want_ids[0][want_mask[0].bool()])
        text = trainer.decode_responses(out.response_ids[i : i + 1], out.response_mask[i : i + 1])[0]
        assert text == out.responses[i]
        assert float(out.scores[i]) == half_constant(row["prompt"], text, None)


def test_filter_groups_fills_the_batch_with_varied_groups(tmp_path):
    trainer = _trainer(tmp_path, "algorithm.max_resample_rounds=8")
    first, out, metrics = _sampled(trainer)
    assert not bool(varied_groups(first).all())  # the first draw had equal-reward groups
    _assert_aligned(trainer, out)
    assert metrics["dynamic_sampling/rounds"] >= 1
    assert metrics["dynamic_sampling/filled_equal_frac"] == 0.0
    assert bool(varied_groups(out).all())
    assert 0 < metrics["dynamic_sampling/varied_group_frac"] < 1


def test_without_resampling_rounds_equal_groups_fill_the_rest_and_are_skipped(tmp_path):
    trainer = _trainer(tmp_path, "algorithm.max_resample_rounds=0")
    first, out, metrics = _sampled(trainer)
    _assert_aligned(trainer, out)
    equal = float((~varied_groups(first)).float().mean())
    assert metrics["dynamic_sampling/rounds"] == 0.0
    assert metrics["dynamic_sampling/filled_equal_frac"] == equal > 0
    assert sorted(out.group_ids.tolist()) == sorted(first.group_ids.tolist())  # the same groups, varied first
    assert bool(varied_groups(out)[: len(out) - int(equal * len(out))].all())


def test_a_step_with_filter_groups_trains_and_logs(tmp_path):
    trainer = _trainer(tmp_path, "algorithm.max_resample_rounds=2")
    metrics = trainer.step()
    assert {"dynamic_sampling/rounds", "dynamic_sampling/varied_group_frac", "dynamic_sampling/filled_equal_frac",
            "timing/resample", "actor/skipped_frac"} <= set(metrics)
    assert metrics["actor/grad_norm"] > 0


def test_dynamic_sampling_with_a_reward_model_on_its_own_ranks_is_refused_at_start_up():
    """Found by the start-up checks (verl check, before any model loads), not at the first step."""
    from verl.config import load_config
    from verl.trainer.checks.startup import check_startup

    overrides = ["algorithm.filter_groups=true", "reward.model_path=tiny", "devices.actor=[0]", "devices.reward=[1]"]
    problems = [str(p)
                for p in check_startup(load_config(overrides=overrides), world_size=2, device_type="cpu").problems]
    assert any("algorithm.filter_groups needs the rewards on the actor's ranks" in p and "devices.reward=[1]" in p
               and "set algorithm.filter_groups=false" in p for p in problems), problems
    colocated = check_startup(load_config(overrides=overrides[:2]), world_size=1, device_type="cpu").problems
    assert not any("filter_groups" in str(p) for p in colocated)


def always_right(prompt, response, ground_truth, **meta):
    return 1.0


def right_but_styled(prompt, response, ground_truth, **meta):
    """Every answer correct (`acc` 1), a score that also rewards style (varies with the response)."""
    return {"score": 1.0 + float(sum(map(ord, response)) % 5) / 10, "acc": 1.0}


def test_groups_are_filtered_on_accuracy_not_on_the_overlong_shaped_score(tmp_path):
    """DAPO filters on correctness: the overlong penalty makes the scores of an all-right group differ, yet
    the group carries no signal about correctness and is filtered out (here: every group)."""
    trainer = RLTrainer(rl_config(tmp_path, "algorithm.filter_groups=true", "algorithm.max_resample_rounds=0",
                                  "data.train_batch_size=8", "rollout.max_new_tokens=6", "algorithm.overlong_buffer=5",
                                  reward={"name": f"{__file__}:always_right"}))
    first, out, metrics = _sampled(trainer)
    shaped = first.scores.clone()
    first.accuracy = None
    assert bool(varied_groups(first).any())  # the shaped scores differ within some group ...
    assert torch.equal(out.accuracy, torch.ones(len(out)))  # ... the accuracies (pre-shaping scores) do not
    assert metrics["dynamic_sampling/varied_group_frac"] == 0.0
    assert metrics["dynamic_sampling/filled_equal_frac"] == 1.0
    assert not bool(varied_groups(out).any()) and bool((shaped < 1).any())


def test_groups_are_filtered_on_the_rewards_acc_extra(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path, "algorithm.filter_groups=true", "algorithm.max_resample_rounds=0",
                                  "data.train_batch_size=8", "rollout.max_new_tokens=6",
                                  reward={"name": f"{__file__}:right_but_styled"}))
    first, out, metrics = _sampled(trainer)
    assert len(set(first.scores.tolist())) > 1 and torch.equal(first.accuracy, torch.ones(len(first)))
    assert metrics["dynamic_sampling/varied_group_frac"] == 0.0
    assert metrics["dynamic_sampling/filled_equal_frac"] == 1.0
