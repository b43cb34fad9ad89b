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
                                  "actor.old_logprobs=recompute", "actor.ppo_epochs=2"))
    trainer.fit()
    rollouts, tokens = read(run_dir, "rollouts.jsonl"), read(run_dir, "tokens.jsonl")
    assert [r["step"] for r in rollouts] == [1, 1, 1, 2, 2, 2] and [t["step"] for t in tokens] == [1, 1, 2, 2]
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
            # before the update the trainer's log-probs are the old policy's (the same weights and kernel)
            assert v["logprob"] == pytest.approx(batch.old_logprobs[i, :n].tolist(), abs=1e-4)
            assert v["sampler_logprob"] == pytest.approx(batch.rollout_logprobs[i, :n].tolist(), abs=1e-4)
            assert v["logprob_gap"] == pytest.approx([a - b for a, b in zip(v["logprob"], v["sampler_logprob"],
                                                                           strict=True)], abs=1e-3)
            assert v["advantage"] == pytest.approx(batch.advantages[i, :n].tolist(), abs=1e-4)
            assert all(e is not None and e > 0 for e in v["entropy"])
            assert all(r > 0 for r in v["ratio"]) and len(tok["clipped"]) == n


def test_no_update_means_a_ratio_of_one_and_nothing_clipped(tmp_path):
    run_dir = tmp_path / "run"
    trainer = RLTrainer(rl_config(run_dir, "trainer.total_steps=1", "rollout.max_new_tokens=4"))
    trainer.update_policy = lambda batch: {}  # the step changes no weight
    trainer.fit()
    tokens = read(run_dir, "tokens.jsonl")
    assert len(tokens) == 2  # the default logging.token_samples
    for tok in tokens:
        assert tok["values"]["ratio"] == pytest.approx([1.0] * len(tok["tokens"]), abs=1e-5)
        assert tok["clipped"] == [0] * len(tok["tokens"])


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


def test_off_writes_nothing_and_costs_no_forward(tmp_path):
    run_dir = tmp_path / "run"
    trainer = RLTrainer(rl_config(run_dir, "trainer.total_steps=1", "rollout.max_new_tokens=2",
                                  "logging.rollout_samples=0"))
    assert trainer.trace is None
    history = trainer.fit()
    assert not (run_dir / "rollouts.jsonl").exists() and not (run_dir / "tokens.jsonl").exists()
    assert "timing/trace" not in history[-1]
    only_rollouts = RLTrainer(rl_config(tmp_path / "b", "trainer.total_steps=1", "rollout.max_new_tokens=2",
                                        "logging.token_samples=0"))
    only_rollouts.trace.forward = lambda rows: pytest.fail("no token values, no forward")
    only_rollouts.fit()
    assert len(read(tmp_path / "b", "rollouts.jsonl")) == 4 and not (tmp_path / "b" / "tokens.jsonl").exists()


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
