"""Multi-process runs on CPU/gloo: FSDP equivalence and matrix, collective timeouts, split placement."""

from __future__ import annotations

import json
from pathlib import Path

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import pytest
import torch

pytestmark = pytest.mark.dist


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_rank")
    W.launch(W.two_rank_worker, 2, str(out))
    return out


def test_one_rank_and_two_ranks_give_the_same_losses_and_weights(two_rank_run):
    ref_losses, ref_state = W.reference_run("sgd")
    got = torch.load(two_rank_run / "equivalence.pt", weights_only=True)
    assert len(got["losses"]) == W.STEPS
    for a, b in zip(got["losses"], ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert set(got["state"]) == set(ref_state)
    for name, value in ref_state.items():
        assert got["state"][name].shape == value.shape
        assert rel_err(got["state"][name], value) <= 1e-5, name
    # the run moved the weights, so agreement is not agreement of two untouched inits
    assert rel_err(W.tiny_qwen2().state_dict()["lm_head.weight"], ref_state["lm_head.weight"]) > 1e-2


def test_every_fsdp_combination_trains(two_rank_run):
    ref_losses = W.reference_run("adamw")[0][:2]
    matrix = torch.load(two_rank_run / "matrix.pt", weights_only=True)["matrix"]
    assert len(matrix) == 40
    for cfg_json, losses in matrix:
        cfg = json.loads(cfg_json)
        assert all(torch.isfinite(torch.tensor(losses))), cfg
        # fp32 combinations are the same math as the single-process reference; bf16 compute is close
        tol = 2e-2 if cfg["mixed_precision"] else 1e-5
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= tol * abs(b), (cfg, losses, ref_losses)
        assert losses[1] < losses[0], cfg


def test_a_rank_that_never_arrives_raises_a_timeout_naming_stage_and_ranks(two_rank_run):
    msg = (two_rank_run / "timeout.txt").read_text()
    assert msg.startswith(
        "collective timeout at stage 'ref_logprobs' (group [0, 1], call #0) on rank 0: "
        "rank(s) [1] did not arrive within 2s"
    )
    assert "Fix:" in msg and "devices.timeout_s" in msg


def test_ranks_at_different_collectives_raise_instead_of_hanging(two_rank_run):
    msg0 = (two_rank_run / "mismatch0.txt").read_text()
    msg1 = (two_rank_run / "mismatch1.txt").read_text()
    assert "rank 0 is at stage 'reward_scores' but {1: 'critic_values'}" in msg0
    assert "rank 1 is at stage 'critic_values' but {0: 'reward_scores'}" in msg1
    assert "would deadlock" in msg0 and "Fix:" in msg0


def test_split_mapping_moves_batches_between_groups(tmp_path):
    W.launch(W.split_worker, 4, str(tmp_path))
    rec = [torch.load(tmp_path / f"split{r}.pt", weights_only=True) for r in range(4)]
    ids = W.global_batch()
    reward = torch.arange(W.GLOBAL_BATCH, dtype=torch.float64)
    # ref [0] gets the whole actor batch, in rank order, dtypes preserved
    assert torch.equal(rec[0]["to_ref"]["input_ids"], ids)
    assert rec[0]["to_ref"]["mask"].dtype == torch.bool and rec[0]["to_ref"]["reward"].dtype == torch.float64
    assert all(rec[r]["to_ref"] is None for r in (1, 2, 3))
    # critic [2,3] each get their half
    assert torch.equal(rec[2]["to_critic"]["input_ids"], ids[:2])
    assert torch.equal(rec[3]["to_critic"]["input_ids"], ids[2:])
    assert rec[0]["to_critic"] is None and rec[1]["to_critic"] is None
    # critic -> reward [3]: the whole batch with the critic's new field
    assert torch.equal(rec[3]["to_reward"]["values"], reward * 10)
    # reward -> actor [0,1]: back to a two-way split
    assert torch.equal(rec[0]["back"]["values"], reward[:2] * 10)
    assert torch.equal(rec[1]["back"]["input_ids"], ids[2:])
    assert rec[2]["back"] is None and rec[3]["back"] is None
    # both groups trained their own FSDP model; ranks of a group agree on the loss
    assert rec[0]["actor_losses"] == rec[1]["actor_losses"]
    assert rec[2]["critic_losses"] == rec[3]["critic_losses"]
    assert "critic_losses" not in rec[0] and "actor_losses" not in rec[3]
    for r in (0, 1):  # both actor ranks refuse shards of other widths, with the same message
        assert "stage 'ragged:gather[actor]': rank 1's batch fields" in rec[r]["ragged"], rec[r].get("ragged")
        assert "padded to one width" in rec[r]["ragged"]
    assert "ragged" not in rec[2] and "ragged" not in rec[3]
