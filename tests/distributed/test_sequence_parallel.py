"""Sequence parallelism (`actor.sequence_parallel_size`) on 2 gloo ranks against one rank, float32: the split
forward's log-probs, entropy, loss and summed gradients; the optimize loop with FSDP2 and pooled rows;
pooling uneven shards."""

from pathlib import Path

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import _sp_workers as SP  # noqa: E402
import pytest
import torch

pytestmark = pytest.mark.dist


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """Within `tol` relative to the tensor's scale (entries that are mathematically 0, such as the key bias's
    gradient, hold rounding noise in both)."""
    scale = max(float(want.abs().max()), 1e-12)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _same_grads(summed: dict, want: dict, what: str) -> None:
    """The gradients summed over the ranks against one rank's, parameter by parameter."""
    for param, g in want.items():
        _close(summed[param], g, f"{what} grad {param}")


def test_split_forward_equals_one_rank_loss_gradients_logprobs_and_padding_changes_nothing(tmp_path):
    W.launch(SP.forward_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"forward{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        loss_mask, attended = (m.bool() for m in res["masks"])
        assert (attended & ~loss_mask).any()  # an observation inside a response
        mask = attended
        for name in ("sdpa_kv2", "eager_kv1", "sdpa_kv2_ckpt", "sdpa_kv2_chunked"):
            case = res[name]
            loss, ref_loss = case["loss"]
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), name
            for key in ("logprobs", "entropy"):
                got, want = case[key]
                _close(got[mask], want[mask], f"{name} {key}")
                assert (got[~mask] == 0).all(), f"{name}: padded {key} are 0"
            summed, want = case["grads"]
            assert sum(float(g.abs().sum()) for g in want.values()) > 0
            _same_grads(summed, want, name)
            metrics, ref_metrics = case["metrics"]
            for key, value in ref_metrics.items():
                assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        narrow, wide = res["padding"]
        _close(wide[:, : narrow.shape[1]], narrow, "wider padding")
        assert (wide[:, narrow.shape[1]:] == 0).all()
        plain, before = res["fallback"]
        assert torch.equal(plain, before), "without the keyword the attention is the original"


def test_sft_and_dpo_target_logprobs_split_equal_one_rank_with_and_without_the_chunked_head(tmp_path):
    W.launch(SP.target_worker, 2, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"target{r}.pt", weights_only=False)
        assert len(res[2]["logprobs"][1]) == 1  # the row with one target
        for name, case in zip(("plain", "chunked", "one target"), res.values(), strict=True):
            got, want = case["logprobs"]
            assert name == "one target" or len(want) == int((SP.sft_batch()["targets"] != -100).sum())
            _close(got, want, f"{name} logprobs")
            assert torch.equal(*case["rows"])
            _same_grads(*case["grads"], name)


def test_critic_values_loss_and_gradients_split_equal_one_rank(tmp_path):
    W.launch(SP.critic_worker, 2, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"critic{r}.pt", weights_only=False)
        loss, ref_loss = res["loss"]
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and ref_loss > 0
        got, want = res["values"]
        attended = res["attended"]
        _close(got[attended], want[attended], "values")
        assert (got[~attended] == 0).all()
        summed, want_grads = res["grads"]
        assert float(want_grads["value_head.weight"].abs().sum()) > 0 and float(want.abs().max()) > 0
        assert float(want_grads["backbone.layers.0.self_attn.q_proj.weight"].abs().sum()) > 0
        _same_grads(summed, want_grads, "critic")


def test_optimize_with_fsdp_and_pooled_rows_equals_one_process(tmp_path):
    W.launch(SP.optimize_worker, 2, str(tmp_path))
    for r in range(2):
        record = torch.load(tmp_path / f"optimize{r}.pt", weights_only=False)
        assert record["sp_ranks"] == (0, 1)
        for name in ("micro", "budget", "seq_mean"):
            case = record[name]
            assert case["pooled_rows"] == 8 and case["own"] == (4 * r, 4)
            state, ref = case["state"]
            moved = sum(float((ref[k] - SP.tiny().state_dict()[k]).abs().sum()) for k in ref)
            assert moved > 0
            for key, value in ref.items() if r == 0 else ():  # the full state dict is gathered on rank 0
                _close(state[key], value, f"{name} {key}")
            metrics, ref_metrics = case["metrics"]
            for key, value in ref_metrics.items():
                assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


@pytest.mark.slow
def test_sequence_and_data_parallel_on_four_ranks_equal_one_process(tmp_path):
    """Two sequence-parallel groups of 2 (ranks 0,1 and 2,3), FSDP over all 4."""
    W.launch(SP.optimize_worker, 4, str(tmp_path))
    for r in (0, 3):
        record = torch.load(tmp_path / f"optimize{r}.pt", weights_only=False)
        assert record["sp_ranks"] == ((0, 1) if r == 0 else (2, 3))
        for name in ("micro", "budget", "seq_mean"):
            case = record[name]
            assert case["pooled_rows"] == 4 and case["own"] == (2 * (r % 2), 2)
            state, ref = case["state"]
            for key, value in ref.items() if r == 0 else ():  # the full state dict is gathered on rank 0
                _close(state[key], value, f"{name} {key}")


def test_pooling_uneven_shards_gives_every_rank_the_same_rows_and_its_own_back(tmp_path):
    W.launch(SP.pool_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"pool{r}.pt", weights_only=False) for r in range(2)]
    first, second = ranks[0]["mine"], ranks[1]["mine"]
    for res in ranks:
        pooled = res["pooled"]
        assert pooled["prompt_ids"].shape == (5, SP.PROMPT) and pooled["response_ids"].shape == (5, SP.RESPONSE)
        assert torch.equal(pooled["prompt_ids"][:3, 2:], first["prompt_ids"])  # left-padded back to 6
        assert (pooled["prompt_ids"][:3, :2] == 0).all() and (pooled["prompt_mask"][:3, :2] == 0).all()
        assert torch.equal(pooled["response_mask"][:3, :8], first["response_mask"])  # right-padded back to 10
        assert (pooled["advantages"][:3, 8:] == 0).all()
        for key in ("prompt_ids", "response_ids", "advantages", "group_ids", "finished"):
            assert torch.equal(pooled[key][3:], second[key]), key
        assert pooled["finished"].dtype == torch.bool
        for key in pooled:
            assert torch.equal(pooled[key], ranks[0]["pooled"][key])
    assert torch.equal(ranks[0]["own"], first["advantages"]) and torch.equal(ranks[1]["own"], second["advantages"])


def _rl_config(tmp_path, size: int, estimator: str = "grpo"):
    import yaml

    here = Path(__file__).resolve().parent
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 2}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 5},
        # the KL loss needs the reference and the old log-probs pass (on the pooled rows); the reward differs
        # between a prompt's samples, so the policy-gradient term is not 0
        "actor": {"lr": 1e-3, "micro_batch_size": 2, "entropy_coef": 0.01, "kl_loss_coef": 0.1,
                  "sequence_parallel_size": size},
        # GAE unwhitened: whitened advantages make pg_loss float32 noise around 0 (exactly 0 on some CPUs)
        "algorithm": {"adv_estimator": estimator, "whiten_advantages": estimator != "gae"},
        "critic": {"lr": 1e-3},
        "trainer": {"total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / f"run{size}"), "cpu_threads": 1,
                    "val_before_train": False},
        "reward": {"functions": [{"name": f"{here / 'row_reward.py'}:response_chars_reward"}]},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"sp{size}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_rl_trainer_with_sequence_parallel_matches_data_parallel(tmp_path, estimator):
    """`verl train` on 2 ranks: sequence-parallel (one group of 2) and data-parallel (2 replicas) runs sample the
    same rows (same per-rank streams) and must update alike; with GAE the critic on the actor's ranks splits
    its sequences too."""
    from launch_support import metrics, verl_train

    runs = {}
    for size in (1, 2):
        verl_train(_rl_config(tmp_path, size, estimator), tmp_path, nproc=2)
        runs[size] = metrics(tmp_path / f"run{size}")
    assert [r["step"] for r in runs[2]] == [1, 2]
    # Step 1 samples from the same weights and computes one gradient: equal up to float rounding. (After it,
    # Adam's first step turns rounding noise on parameters with a zero gradient into lr-sized moves.)
    first_dp, first_sp = runs[1][0], runs[2][0]
    assert first_sp["reward/mean"] == first_dp["reward/mean"] and first_dp["reward/std"] > 0
    critic = ("critic/vf_loss", "critic/grad_norm", "critic/values_mean") if estimator == "gae" else ()
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/clipfrac",
                "actor/approx_kl", *critic):
        assert first_sp[key] == pytest.approx(first_dp[key], rel=1e-5, abs=1e-7), key
    assert first_sp["actor/grad_norm"] > 0 and first_sp["actor/pg_loss"] != 0
    # the old log-probs equal the sampler's on both: this metric is float32 rounding (~2e-7), not compared
    assert first_sp["rollout/logprob_diff_mean"] < 1e-5 and first_dp["rollout/logprob_diff_mean"] < 1e-5
