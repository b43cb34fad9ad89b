"""The asynchronous rollout's checks and pieces that need no processes: the placement rules, what `verl check`
says, the weight buckets, the prompt-stream guard and the staleness metrics."""

from pathlib import Path

import pytest
import torch

from verl.batch import RolloutBatch
from verl.config import load_config, split_legacy_flags
from verl.errors import DistributedError
from verl.rollout.async_rollout import DRAWN, buckets, merge, staleness_metrics, text_tensor, texts_of
from verl.trainer.checks.preflight import preflight


def _check(*overrides, world=2):
    config = load_config(overrides=["env.name=arithmetic", *overrides])
    return preflight(config, world_size=world, device_type="cpu", check_model=False)


def test_rollout_ranks_may_not_overlap_a_training_role():
    [problem] = _check("devices.rollout=[1]").messages
    assert "devices.rollout=[1] overlaps devices.actor=[0, 1] on rank(s) [1]" in problem
    assert "Fix: give actor other ranks (e.g. devices.actor=[0])" in problem
    overrides, _ = split_legacy_flags(["--rollout_device_ids", "1", "--actor_device_ids", "0"])
    assert _check(*overrides).messages == []


def test_verl_check_prints_the_async_plan():
    notes = _check("devices.actor=[0]", "devices.rollout=[1]").startup.rl_notes
    assert ("asynchronous rollout: rank(s) [1] generate, rank(s) [0] train; rollout.max_staleness=1 (one-step "
            "off-policy), a queue of at most 1 batch(es) ahead; the new weights go to the rollout ranks after "
            "every update") in [n.split("; partial rollouts")[0] for n in notes]
    assert any(n.startswith("rollout correction: token_tis") and "max_staleness=1" in n for n in notes)
    assert any("partial rollouts: single-turn responses take new weights between two tokens (multi-turn and agent "
               "episodes are sampled by one version each)" in n for n in notes)
    sync = _check("devices.actor=[0]", "devices.rollout=[1]", "rollout.max_staleness=0").startup.rl_notes
    assert any("(synchronous on the split ranks)" in n for n in sync)
    assert any(n.startswith("rollout correction: off") for n in sync)  # k = 0: the exact no-op


def test_vllm_on_rollout_ranks_is_planned_with_partial_rollouts_off():
    """Not refused (only this CPU machine and the missing vllm are); `verl check` says what changes."""
    checks = _check("devices.actor=[0]", "devices.rollout=[1]", "rollout.engine=vllm")
    assert all("needs a CUDA GPU" in m or "vllm package is not installed" in m
               for m in checks.messages), checks.messages
    [note] = [n for n in checks.startup.rl_notes if n.startswith("asynchronous rollout")]
    assert "loaded into the rollout ranks' vLLM engines (kept awake; their Hugging Face copy of the policy stays " \
           "on the CPU)" in note
    assert "rollout.partial_rollout is off with rollout.engine=vllm (vLLM samples a batch in one call" in note
    off = _check("devices.actor=[0]", "devices.rollout=[1]", "rollout.engine=vllm", "rollout.partial_rollout=false")
    assert not any("partial_rollout" in n for n in off.startup.rl_notes)
    assert not any("vLLM" in n for n in _check("devices.actor=[0]", "devices.rollout=[1]").startup.rl_notes)


def test_partial_rollouts_only_on_our_sampler():
    from verl.rollout.async_rollout import takes_partial_rollouts

    def takes(*overrides):
        return takes_partial_rollouts(load_config(overrides=["env.name=arithmetic", *overrides]), env=None)

    assert takes() and not takes("rollout.engine=vllm") and not takes("rollout.partial_rollout=false")


def test_verl_check_says_where_agent_episodes_run():
    agent = Path(__file__).resolve().parent.parent / "distributed" / "agent_letters.py"
    report = _check("devices.actor=[0]", "devices.rollout=[1]", f"env.agent={agent}:run")
    assert report.messages == []
    assert any("env.agent: the agents' OpenAI endpoint runs on the rollout rank(s) and their stitched episodes "
               "(tokens, log-probs, masks, rewards, text, episode metrics) go to the actor rank(s)" in n
               for n in report.startup.rl_notes)
    messages = _check("devices.actor=[0]", "devices.rollout=[1]", f"env.agent={agent}:run",
                      "rollout.engine=vllm").messages
    assert any("env.agent samples on the 'hf' rollout engine" in m and "Fix: rollout.engine=hf" in m
               for m in messages), messages


def test_buckets_group_by_dtype_and_size():
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n, dtype=d))) for i, (n, d) in
              enumerate([(10, torch.float32), (10, torch.float32), (100, torch.float32), (4, torch.bfloat16),
                         (4, torch.float32)])]
    assert list(buckets(params, limit=100)) == [[0, 1], [2], [3], [4]]  # 80 bytes fit, 400 alone, dtype breaks
    assert list(buckets(params, limit=10**6)) == [[0, 1, 2], [3], [4]]


def _drawn(ids):
    ids = torch.tensor(ids)
    return RolloutBatch(rows=[{}] * len(ids), group_ids=torch.arange(len(ids)), prompt_ids=ids,
                        prompt_mask=(ids != 0).long())


def test_the_sampled_prompts_must_be_the_drawn_ones():
    drawn = _drawn([[0, 5, 6], [7, 8, 9]])
    sampled = {"prompt_ids": torch.tensor([[5, 6], [7, 8]]), "prompt_mask": torch.ones(2, 2, dtype=torch.long),
               "response_ids": torch.ones(2, 3, dtype=torch.long), "response_mask": torch.ones(2, 3, dtype=torch.long),
               "rollout_version": torch.full((2, 3), 3.0)}
    with pytest.raises(DistributedError, match="step 5: the rollout ranks sampled other prompts"):
        merge(drawn, sampled, step=4)
    sampled["prompt_ids"] = torch.tensor([[5, 6, 0], [7, 8, 9]])  # the same tokens, padded on the other side
    sampled["prompt_mask"] = torch.tensor([[1, 1, 0], [1, 1, 1]])
    merged = merge(_drawn([[0, 5, 6], [7, 8, 9]]), sampled, step=4)
    assert torch.equal(merged.response_ids, sampled["response_ids"])
    assert staleness_metrics(sampled, step=4) == {"async/staleness": 1.0, "async/version": 3.0,
                                                  "async/staleness_tokens_0": 0.0, "async/staleness_tokens_1": 1.0,
                                                  "async/partial_frac": 0.0}


def test_an_episode_prompt_is_checked_against_the_drawn_one():
    """A tool environment's or an agent's episode prompt is another rendering of the row: the rollout ranks
    send the prompts as they drew them (DRAWN), which the trainer's must equal."""
    drawn = _drawn([[0, 5, 6], [7, 8, 9]])
    episode = {"prompt_ids": torch.tensor([[1, 2, 5, 6], [1, 2, 7, 8]]),
               "prompt_mask": torch.ones(2, 4, dtype=torch.long), DRAWN: torch.tensor([[2, 11], [3, 24]])}
    merged = merge(drawn, dict(episode), step=0)
    assert torch.equal(merged.prompt_ids, episode["prompt_ids"]) and not hasattr(merged, DRAWN)
    with pytest.raises(DistributedError, match="step 1: the rollout ranks sampled other prompts"):
        merge(_drawn([[0, 5, 6], [7, 8, 8]]), dict(episode), step=0)


def test_response_text_travels_as_bytes():
    texts = ["plain", "", "ünïcode → ok\n[agent failed]\nTraceback", "x"]
    assert texts_of(text_tensor(texts)) == texts
    assert text_tensor([]).shape == (0, 0)


def test_staleness_of_a_partial_rollout_is_counted_per_token():
    """Row 0 took version 4 after its second token; row 1 ended (padding) before the switch."""
    sampled = {"response_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
               "rollout_version": torch.tensor([[3.0, 3.0, 4.0, 4.0], [3.0, 3.0, 4.0, 4.0]])}
    metrics = staleness_metrics(sampled, step=4)
    assert metrics["async/staleness"] == 1.0 and metrics["async/version"] == 4.0
    assert metrics["async/staleness_tokens_0"] == pytest.approx(2 / 6)
    assert metrics["async/staleness_tokens_1"] == pytest.approx(4 / 6)
    assert metrics["async/partial_frac"] == 0.5


def test_max_staleness_without_rollout_ranks_is_said_to_do_nothing():
    notes = _check("rollout.max_staleness=2", world=1).startup.rl_notes
    assert any(n.startswith("rollout.max_staleness=2 has no effect") and "devices.rollout" in n for n in notes)
    assert not any("max_staleness" in n for n in _check(world=1).startup.rl_notes)


def test_multi_turn_episodes_on_vllm_rollout_ranks_are_refused():
    messages = _check("env.name=calculator", "devices.actor=[0]", "devices.rollout=[1]", "rollout.engine=vllm").messages
    assert any("environment CalculatorEnv runs multi-turn episodes, which sample on the 'hf' rollout engine" in m
               and "Fix: rollout.engine=hf" in m for m in messages), messages
