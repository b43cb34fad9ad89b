"""`logging.rollout_samples` / `logging.token_samples`: each RL step writes a few rollouts to rollouts.jsonl and
the per-token values of fewer to tokens.jsonl (what `verl view` shows). The values are checked against the
batch the step trained on and against exact identities (a ratio of 1 where the update changed no weight)."""

from __future__ import annotations

import json

import pytest
from rl_support import rl_config
from test_rl_multiturn import mt_config

from verl.batch import RolloutBatch
from verl.tracking.tracker import Tracker
from verl.trainer.rl.trace import compact, episode_trace, picked_rows, prompt_text
from verl.trainer.rl_trainer import RLTrainer


def read(run_dir, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


class Recording(RLTrainer):
    """Keeps each step's batch after the update, to check the rows against."""

    def update_policy(self, batch: RolloutBatch):
        self.batches = [*getattr(self, "batches", []), batch]
        return super().update_policy(batch)


def test_rows_match_the_batch_the_step_trained_on(tmp_path):
    run_dir = tmp_path / "run"
    trainer = Recording(rl_config(run_dir, "trainer.total_steps=2", "rollout.max_new_tokens=4", "rollout.n=4",
                                  "logging.rollout_samples=3", "logging.token_samples=2",
                                  "actor.old_logprobs=recompute", "actor.ppo_epochs=2", "actor.mini_batch_size=2",
                                  "actor.skip_zero_advantage=false"))
    trainer.fit()
    rollouts, tokens = read(run_dir, "rollouts.jsonl"), read(run_dir, "tokens.jsonl")
    assert [r["step"] for r in rollouts] == [1, 1, 1, 2, 2, 2] and [t["step"] for t in tokens] == [1, 1, 2, 2]
    assert [r["sample"] for r in rollouts] == [0, 1, 2] * 2 and [t["sample"] for t in tokens] == [0, 1] * 2
    ratios = []
    for step, batch in enumerate(trainer.batches, start=1):
        picked = picked_rows(3, len(batch))
        assert len(set(picked)) == 3 and len({int(batch.group_ids[i]) for i in picked}) == 3  # three prompts
        for row, i in zip([r for r in rollouts if r["step"] == step], picked, strict=True):
            mask = batch.response_mask[i].double()
            assert row["group"] == str(int(batch.group_ids[i])) and row["prompt"] == batch.rows[i]["prompt"]
            assert row["response"] == batch.responses[i] and row["ground_truth"] == batch.rows[i]["ground_truth"]
            assert row["reward"] == pytest.approx(float(batch.scores[i]), abs=1e-4)
            assert row["rewards"] == {"digit_reward": pytest.approx(float(batch.scores[i]), abs=1e-4)}
            expected = float((batch.advantages[i].double() * mask).sum() / mask.sum())
            assert row["advantage"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
            assert row["response_length"] == int(mask.sum()) and row["episode"] is None
        for tok, i in zip([t for t in tokens if t["step"] == step], picked[:2], strict=True):
            n = int(batch.response_mask[i].sum())
            assert len(tok["tokens"]) == n and tok["masked"] == [0] * n
            assert "".join(tok["tokens"]) == trainer.tokenizer.decode(batch.response_ids[i, :n].tolist())
            v = tok["values"]
            assert all(len(x) == n for x in v.values())
            assert v["sampler_logprob"] == pytest.approx(batch.rollout_logprobs[i, :n].tolist(), abs=1e-4)
            assert v["old_logprob"] == pytest.approx(batch.old_logprobs[i, :n].tolist(), abs=1e-4)
            assert v["logprob_gap"] == pytest.approx([a - b for a, b in zip(v["old_logprob"], v["sampler_logprob"],
                                                                           strict=True)], abs=1e-3)
            assert v["advantage"] == pytest.approx(batch.advantages[i, :n].tolist(), abs=1e-4)
            assert all(e is not None and e > 0 for e in v["entropy"])
            # `clipped` is PPO's rule on the ratio the loss saw last (values rounded: skip the boundaries)
            for r, a, c in zip(v["ratio"], v["advantage"], tok["clipped"], strict=True):
                if min(abs(r - 1.2), abs(r - 0.8)) > 1e-3:
                    assert c == int((a > 0 and r > 1.2) or (a < 0 and r < 0.8))
            ratios += v["ratio"]
    assert any(abs(r - 1) > 1e-3 for r in ratios)  # the second epoch saw the weights its first pass moved


def test_a_single_pass_before_the_step_sees_the_sampling_weights(tmp_path):
    """One epoch of one mini-batch: every row's pass precedes the optimizer step, so the loss's log-probs are the
    sampler's (on this engine, within its drift), the ratio is 1 and nothing is clipped."""
    run_dir = tmp_path / "run"
    RLTrainer(rl_config(run_dir, "trainer.total_steps=1", "rollout.max_new_tokens=4",
                        "actor.skip_zero_advantage=false")).fit()
    tokens = read(run_dir, "tokens.jsonl")
    assert len(tokens) == 2  # the default logging.token_samples
    for tok in tokens:
        v = tok["values"]
        assert v["ratio"] == [1.0] * len(tok["tokens"]) and tok["clipped"] == [0] * len(tok["tokens"])
        assert v["logprob"] == pytest.approx(v["sampler_logprob"], abs=1e-4)
        assert v["logprob_gap"] == pytest.approx([a - b for a, b in zip(v["logprob"], v["sampler_logprob"],
                                                                       strict=True)], abs=1e-3)
        assert "old_logprob" not in v  # on-policy single step: no old log-prob pass


def test_multi_turn_episodes_are_traced_as_turns_with_observations_masked(tmp_path):
    run_dir = tmp_path / "run"
    RLTrainer(mt_config(run_dir, "trainer.total_steps=1", "logging.rollout_samples=4",
                        "logging.token_samples=4")).fit()
    rollouts, tokens = read(run_dir, "rollouts.jsonl"), read(run_dir, "tokens.jsonl")
    assert len(rollouts) == len(tokens) == 4
    for row, tok in zip(rollouts, tokens, strict=True):
        ep = row["episode"]
        assert ep["status"] in ("ok", "truncated") and ep["turns"][0]["role"] == "assistant"
        assert [t["role"] for t in ep["turns"]] == ["assistant" if t["trained"] else "tool" for t in ep["turns"]]
        # the turns cover the tokens: observation turns are exactly the masked tokens
        assert "".join(t["text"] for t in ep["turns"]) == "".join(tok["tokens"])
        assert sum(len(t["text"]) for t in ep["turns"] if not t["trained"]) == sum(
            len(piece) for piece, off in zip(tok["tokens"], tok["masked"], strict=True) if off)
        assert all(v is None for name, values in tok["values"].items()
                   for v, off in zip(values, tok["masked"], strict=True) if off)
        assert [t["reward"] for t in ep["turns"] if t["reward"] is not None] == [
            pytest.approx(row["reward"], abs=1e-4)]  # the episode's reward, on its last model turn
    assert any(t["role"] == "tool" for r in rollouts for t in r["episode"]["turns"])


def test_off_writes_nothing_and_a_skipped_row_keeps_the_batch_values(tmp_path):
    run_dir = tmp_path / "run"
    trainer = RLTrainer(rl_config(run_dir, "trainer.total_steps=1", "rollout.max_new_tokens=2",
                                  "logging.rollout_samples=0"))
    assert trainer.trace is None
    trainer.fit()
    assert not (run_dir / "rollouts.jsonl").exists() and not (run_dir / "tokens.jsonl").exists()
    # a constant reward: every advantage is 0 and actor.skip_zero_advantage leaves every row out of the update
    skipped = RLTrainer(rl_config(tmp_path / "b", "trainer.total_steps=1", "rollout.max_new_tokens=2",
                                  "logging.token_samples=4"),
                        reward_functions=[lambda prompt, response, ground_truth, **kw: 1.0])
    skipped.fit()
    assert len(read(tmp_path / "b", "rollouts.jsonl")) == 4
    for tok in read(tmp_path / "b", "tokens.jsonl"):
        assert set(tok["values"]) == {"sampler_logprob", "advantage"} and "clipped" not in tok
        assert tok["values"]["advantage"] == [0.0] * len(tok["tokens"])


def test_hostile_values_and_text_stay_valid_json():
    assert compact(float("nan")) is None and compact(float("inf")) is None and compact(-float("inf")) is None
    assert compact(1.23456789) == 1.2346 and compact(-1.5e-7) == -1.5e-7
    assert picked_rows(4, 2) == [0, 1] and picked_rows(0, 8) == [] and picked_rows(3, 12) == [0, 4, 8]
    chat = [{"role": "user", "content": "</script><script>alert(1)</script>"}, "stray"]
    assert prompt_text({"prompt": chat}) == "user: </script><script>alert(1)</script>\nstray"
    assert prompt_text({}) == ""

    class Record:
        info = {"agent_failed": True}
        truncated = ""
        transcript = [("agent", "Traceback ... \x00\ud800 boom")]
        reward, tool_calls, tool_errors = 0.0, 0, 0

    ep = episode_trace(Record(), [5, 6, 7], [1, 1, 0], lambda ids: "".join(chr(65 + i) for i in ids))
    assert ep["status"] == "failed" and ep["error"].endswith("boom") and ep["turns"][-1]["error"] == ep["error"]
    assert [t["text"] for t in ep["turns"]] == ["FG", "H"]


def test_a_row_with_a_lone_surrogate_is_written_and_read_back(tmp_path):
    """Text from an agent or a tool may hold a lone surrogate (a JSON "\\ud800" escape): the step's write must
    not fail on it, and the line stays valid JSON."""
    tracker = Tracker(["jsonl"], tmp_path)
    tracker.log_rows("rollouts.jsonl", [{"step": 1, "response": "ok \ud800 \x00 </script>"}], "test rows")
    tracker.close()
    assert read(tmp_path, "rollouts.jsonl") == [{"step": 1, "response": "ok \ud800 \x00 </script>"}]
