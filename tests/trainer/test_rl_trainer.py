"""RLTrainer end to end on the tiny model: what changes, what must not, what gets logged, and learning."""

from __future__ import annotations

import copy

import pytest
import torch
from rl_support import BASE_KEYS, CRITIC_KEYS, changed, digit_reward, read_metrics, rl_config, snapshot

from verl.errors import ConfigError, DataError, ModelError, RewardError
from verl.trainer.rl_trainer import RLTrainer


def _run(config) -> tuple[RLTrainer, dict, dict | None, dict | None, list[dict]]:
    trainer = RLTrainer(config)
    actor0 = snapshot(trainer.model)
    critic0 = snapshot(trainer.critic) if trainer.critic is not None else None
    ref0 = snapshot(trainer.ref_model) if trainer.ref_model is not None else None
    trainer.fit()
    return trainer, actor0, critic0, ref0, read_metrics(trainer.run_dir)


def _assert_all_changed(before: dict, module: torch.nn.Module, what: str) -> None:
    unchanged = [name for name, moved in changed(before, module).items() if not moved]
    assert not unchanged, f"{what} parameters that did not change: {unchanged}"


def test_grpo_three_steps_with_kl_loss(tmp_path):
    config = rl_config(tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_steps=3", "actor.kl_loss_coef=0.01")
    trainer, actor0, critic0, ref0, rows = _run(config)
    assert trainer.critic is None and critic0 is None
    _assert_all_changed(actor0, trainer.model, "actor")
    # the reference is the initial actor, frozen: identical weights, no gradients
    assert ref0 is not None
    assert not any(changed(ref0, trainer.ref_model).values())
    assert all(torch.equal(ref0[name], actor0[name]) for name in actor0)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    assert trainer.ref_model is not trainer.model
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        missing = BASE_KEYS - row.keys()
        assert not missing, f"step {row['step']} lacks {sorted(missing)}"
        assert {"actor/kl_loss", "actor/ref_kl", "timing/ref"} <= row.keys()
        assert not CRITIC_KEYS & row.keys()
        assert 0.0 <= row["reward/zero_std_group_frac"] <= 1.0
        assert row["response/length_max"] <= 4 and 0.0 <= row["response/truncation_ratio"] <= 1.0
        assert row["actor/lr"] == pytest.approx(1e-3)
    # the first step is on-policy against an identical reference: the KL loss is exactly 0; the old log-probs
    # are the sampler's (actor.old_logprobs=auto), the trainer's up to rounding
    assert rows[0]["actor/kl_loss"] == 0.0 and rows[0]["actor/clipfrac"] == 0.0
    assert abs(rows[0]["actor/ref_kl"]) < 1e-6 and abs(rows[0]["actor/approx_kl"]) < 1e-6
    # after an update the policy has moved away from the reference
    assert rows[-1]["actor/ref_kl"] != 0.0
    assert trainer.history[-1]["step"] == 3 and "val/score" in trainer.history[-1]


def test_ppo_three_steps_with_kl_in_reward(tmp_path):
    config = rl_config(tmp_path, "algorithm.adv_estimator=gae", "trainer.total_steps=3",
                       "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.05")
    trainer, actor0, critic0, ref0, rows = _run(config)
    assert trainer.critic is not None and ref0 is not None
    _assert_all_changed(actor0, trainer.model, "actor")
    _assert_all_changed(critic0, trainer.critic, "critic")
    assert not any(changed(ref0, trainer.ref_model).values())
    # the critic is a separate network (a copy of the actor's backbone), not shared weights
    actor_ptrs = {p.data_ptr() for p in trainer.model.parameters()}
    assert not actor_ptrs & {p.data_ptr() for p in trainer.critic.parameters()}
    for row in rows:
        missing = (BASE_KEYS | CRITIC_KEYS | {"kl/in_reward", "kl/coef", "actor/ref_kl"}) - row.keys()
        assert not missing, f"step {row['step']} lacks {sorted(missing)}"
        assert row["kl/coef"] == pytest.approx(0.05)
    assert abs(rows[0]["kl/in_reward"]) < 1e-6 < abs(rows[-1]["kl/in_reward"])  # the sampler's old log-probs
    assert any(row["critic/vf_loss"] > 0 for row in rows)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_other_estimators_two_steps_without_reference(tmp_path, estimator):
    config = rl_config(tmp_path, f"algorithm.adv_estimator={estimator}", "trainer.total_steps=2")
    trainer, actor0, critic0, ref0, rows = _run(config)
    # neither KL option is on: no reference model is built at all, and no critic outside PPO
    assert trainer.ref_model is None and trainer.critic is None
    _assert_all_changed(actor0, trainer.model, "actor")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert not BASE_KEYS - row.keys()
        assert not {"actor/ref_kl", "actor/kl_loss", "kl/in_reward"} & row.keys()


def test_grpo_without_kl_builds_no_reference(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path, "trainer.total_steps=1"))
    assert trainer.ref_model is None
    assert not trainer.needs_old_logprobs  # one on-policy step: the old log-probs pass is skipped


def test_from_pretrained_with_callable_reward_and_rows_learns(tmp_path):
    """A seeded GRPO run on a dense, learnable reward raises the mean reward (not just noise)."""
    rows = [{"question": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    trainer = RLTrainer.from_pretrained(
        "tiny", reward_fn=digit_reward, dataset=rows,
        actor={"lr": 3e-3},
        **{"model.dtype": "float32", "trainer.device": "cpu", "trainer.run_dir": str(tmp_path),
           "trainer.total_steps": 30, "trainer.val_before_train": False, "trainer.resume": "never",
           "data.train_batch_size": 8, "rollout.n": 8, "rollout.max_new_tokens": 4, "logging.backends": ["jsonl"]},
    )
    assert trainer.config.actor.lr == 3e-3 and trainer.config.model.path == "tiny"
    # the rows went through the data layer's aliases: question -> prompt, answer -> ground_truth (text)
    batch_rows = copy.deepcopy(trainer.env).get_batch(16)
    assert {r["prompt"] for r in batch_rows} == {r["question"] for r in rows}
    assert all(isinstance(r["ground_truth"], str) for r in batch_rows)
    history = trainer.fit()
    rewards = [h["reward/mean"] for h in history]
    assert "reward/digit_reward/score" in history[0]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"mean reward did not rise: {rewards}"


def test_from_pretrained_row_errors(tmp_path):
    common = {"trainer.device": "cpu", "trainer.run_dir": str(tmp_path), "model.dtype": "float32",
              "data.train_batch_size": 2, "rollout.max_new_tokens": 2}
    with pytest.raises(DataError, match=r"dataset\[1\].*no key for 'prompt'.*data.fields"):
        RLTrainer.from_pretrained("tiny", reward_fn=digit_reward, dataset=[{"prompt": "a"}, {"text": "b"}], **common)
    with pytest.raises(DataError, match=r"dataset\[0\] is a int"):
        RLTrainer.from_pretrained("tiny", reward_fn=digit_reward, dataset=[3, 4], **common)
    with pytest.raises(ConfigError, match=r"env.name='arithmetic' makes its own prompts"):
        RLTrainer.from_pretrained("tiny", reward_fn=digit_reward, dataset=[{"prompt": "a"}],
                                  **common, **{"env.name": "arithmetic"})
    with pytest.raises(ConfigError, match="reward.functions is empty"):
        RLTrainer.from_pretrained("tiny", dataset=[{"prompt": "a"}, {"prompt": "b"}], **common)


def test_callable_reward_is_checked_and_labelled(tmp_path):
    def two_args(prompt, response):  # cannot take ground_truth: rejected at start-up, named
        return 0.0

    with pytest.raises(RewardError, match=r"reward.functions\[0\] \(callable 'two_args'\).*cannot be called"):
        RLTrainer.from_pretrained("tiny", reward_fn=two_args, dataset=[{"prompt": "a"}, {"prompt": "b"}],
                                  **{"trainer.device": "cpu", "trainer.run_dir": str(tmp_path),
                                     "data.train_batch_size": 2})

    def bad(prompt, response, ground_truth, **meta):
        return None

    trainer = RLTrainer.from_pretrained(
        "tiny", reward_fn=bad, dataset=[{"prompt": "a"}, {"prompt": "b"}],
        **{"trainer.device": "cpu", "trainer.run_dir": str(tmp_path), "model.dtype": "float32",
           "data.train_batch_size": 2, "rollout.max_new_tokens": 2, "logging.backends": ["jsonl"],
           "trainer.val_before_train": False})
    with pytest.raises(RewardError, match="bad"):
        trainer.step()


def _training_rows(trainer: RLTrainer) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(("val/", "timing/", "perf/"))}
            for row in trainer.history]


def test_sampled_validation_never_shifts_training(tmp_path):
    def run(name, *overrides):
        trainer = RLTrainer(rl_config(tmp_path / name, "trainer.total_steps=3", *overrides))
        trainer.fit()
        return trainer

    plain = run("plain", "trainer.val_every=0")
    sampled = run("sampled", "trainer.val_every=1", "rollout.val_temperature=1.0")
    assert _training_rows(sampled) == _training_rows(plain)
    assert [("val/score" in row) for row in sampled.history] == [True, True, True]
    # and the sampled validation itself is reproducible
    again = run("again", "trainer.val_every=1", "rollout.val_temperature=1.0")
    assert [row["val/score"] for row in again.history] == [row["val/score"] for row in sampled.history]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_one_batch(tmp_path, agg):
    """Splitting a mini-batch into uneven micro-batches (16 = 5 x 3 + 1) gives the same gradient."""
    def first_step(name, micro):
        trainer = RLTrainer(rl_config(tmp_path / name, "trainer.total_steps=1", f"actor.loss_agg={agg}",
                                      f"actor.micro_batch_size={micro}", "actor.entropy_coef=0.01",
                                      "actor.dual_clip=3.0", "actor.grad_clip=1000"))
        return trainer.step()

    whole, split = first_step("whole", 16), first_step("split", 3)
    assert split["actor/grad_norm"] > 0
    assert split["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-5)
    assert split["reward/mean"] == whole["reward/mean"]


def test_ref_path_loads_that_model(tmp_path):
    from verl.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)  # same tokenizer, different weights
    trainer = RLTrainer(rl_config(tmp_path / "run", "trainer.total_steps=1", "actor.kl_loss_coef=0.1",
                                  f"ref.path={other}"))
    actor = dict(trainer.model.named_parameters())
    ref = dict(trainer.ref_model.named_parameters())
    assert ref.keys() == actor.keys()
    assert not any(torch.equal(ref[k], actor[k]) for k in ref if k.endswith("q_proj.weight"))
    assert not any(p.requires_grad for p in ref.values())
    metrics = trainer.step()
    assert metrics["actor/ref_kl"] != 0.0 and metrics["actor/kl_loss"] > 0.0  # a different anchor from step 1


def test_ref_path_with_another_tokenizer_is_refused(tmp_path):
    from verl.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=512)
    with pytest.raises(ModelError, match=r"ref.path=.*different tokenizer from model.path='tiny'.*same model family"):
        RLTrainer(rl_config(tmp_path / "run", "actor.kl_loss_coef=0.1", f"ref.path={other}"))


def test_critic_warmup_updates_only_the_critic(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path, "algorithm.adv_estimator=gae", "critic.warmup_steps_critic_only=1",
                                  "trainer.total_steps=2"))
    actor0, critic0 = snapshot(trainer.model), snapshot(trainer.critic)
    first = trainer.step()
    trainer.step_count += 1
    assert not any(changed(actor0, trainer.model).values())  # the policy waits for a trained critic
    # the value head starts at zero, so on the first update only the head itself gets a gradient
    moved = changed(critic0, trainer.critic)
    assert moved["value_head.weight"] and moved["value_head.bias"]
    assert "critic/vf_loss" in first and "actor/pg_loss" not in first
    second = trainer.step()
    assert "actor/pg_loss" in second and all(changed(actor0, trainer.model).values())


def test_a_trl_reward_function_sees_the_training_step(tmp_path):
    """TRL's `trainer_state.global_step` (optimizer steps done before the batch) for curriculum rewards."""
    seen = []

    def by_step(completions, trainer_state, log_metric, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        log_metric("step_seen", trainer_state.global_step)
        return [float(len(c) > 0) for c in completions]

    rows = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(4)]
    trainer = RLTrainer.from_pretrained(
        "tiny", reward_fn=by_step, dataset=rows,
        **{"trainer.device": "cpu", "trainer.run_dir": str(tmp_path), "trainer.total_steps": 3,
           "trainer.val_before_train": False, "data.train_batch_size": 2, "rollout.n": 2,
           "rollout.max_new_tokens": 2, "logging.backends": ["jsonl"]})
    history = trainer.fit()
    assert seen == [(0, 3), (1, 3), (2, 3)]
    assert [h["reward/by_step/step_seen"] for h in history] == [0.0, 1.0, 2.0]


def test_a_trl_reward_function_gets_the_sampled_token_ids_as_completion_ids(tmp_path):
    """TRL's `completion_ids`: each response's sampled ids up to and including its eos, in batch order."""
    seen = []

    def by_ids(completions, completion_ids, **kwargs):
        seen.append(completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    rows = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(4)]
    trainer = RLTrainer.from_pretrained(
        "tiny", reward_fn=by_ids, dataset=rows,
        **{"trainer.device": "cpu", "trainer.run_dir": str(tmp_path), "trainer.total_steps": 1,
           "trainer.val_before_train": False, "data.train_batch_size": 2, "rollout.n": 2,
           "rollout.max_new_tokens": 4, "logging.backends": []})
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    want = [ids[: int(n)].tolist() for ids, n in zip(batch.response_ids, batch.response_mask.sum(dim=1), strict=True)]
    assert seen == [want]
    assert batch.scores.tolist() == [float(len(ids)) for ids in want]
    assert trainer.tokenizer.batch_decode(want, skip_special_tokens=True) == batch.responses


def test_the_overlong_buffer_penalises_responses_that_run_into_the_length_limit(tmp_path):
    """DAPO's overlong reward shaping on the step's scores: the functions' score plus the length penalty."""
    from verl.algorithms import overlong_penalty
    from verl.trainer.checks.startup import check_startup

    trainer = RLTrainer(rl_config(tmp_path, "rollout.max_new_tokens=6", "algorithm.overlong_buffer=3",
                                  "algorithm.overlong_penalty=0.5"))
    batch = trainer.generate(trainer.get_batch())
    plain = trainer.env.compute_reward(batch.rows, batch.responses).scores
    batch = trainer.compute_reward(batch)
    lengths = batch.response_mask.sum(dim=1)
    want = plain + overlong_penalty(lengths.double(), 6, 3, 0.5).float()
    torch.testing.assert_close(batch.scores, want)
    assert batch.metrics["reward/overlong_frac"] == float((lengths > 3).float().mean()) > 0
    assert batch.metrics["reward/overlong_penalty"] == pytest.approx(float((want - plain).mean()))
    # the reward sits on each response's last token, penalty included
    torch.testing.assert_close(batch.token_rewards.sum(dim=1), want)

    too_long = rl_config(tmp_path, "rollout.max_new_tokens=6", "algorithm.overlong_buffer=6")
    problems = [str(p) for p in check_startup(too_long, world_size=1).problems]
    assert any("algorithm.overlong_buffer=6 must be shorter than rollout.max_new_tokens=6" in p for p in problems)


def test_gspo_sequence_ratio_trains_over_several_updates_per_batch(tmp_path):
    """actor.policy_loss=gspo in the update: two PPO epochs of two mini-batches, so the second
    update's ratios are not 1 and the sequence ratio is what clips."""
    trainer = RLTrainer(rl_config(tmp_path, "actor.policy_loss=gspo", "actor.loss_agg=seq-mean-token-mean",
                                  "actor.clip_low=3e-4", "actor.clip_high=4e-4", "actor.ppo_epochs=2",
                                  "actor.mini_batch_size=2", "actor.lr=1e-2", "trainer.total_steps=2"))
    before = snapshot(trainer.model)
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history if "actor/pg_loss" in h)
    assert any(changed(before, trainer.model).values())
    assert max(h.get("actor/clipfrac", 0.0) for h in history) > 0  # the tight ranges clip whole responses
