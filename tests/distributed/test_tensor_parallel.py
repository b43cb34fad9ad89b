"""Tensor parallelism (verl.distributed.tensor_parallel) on gloo ranks against one process, float32: log-probs,
entropy, a GRPO-like loss and the gradients (gathered whole) for Qwen2 (tied embeddings), Llama and Qwen3 with
TP=2, and TP=2 x FSDP2 dp=2; the vocabulary-parallel log-probs against log_softmax in float64; verl's sampler
on the split model (the same tokens); the divisibility errors."""

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import _tp_workers as TP  # noqa: E402
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from verl.distributed.tensor_parallel import check_tensor_parallel
from verl.errors import ConfigError


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """Within `tol` relative to the tensor's scale (entries that are mathematically 0 hold rounding noise)."""
    scale = max(float(want.abs().max()), 1e-12)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _same(case: dict, what: str, rank: int) -> None:
    got, want = case["got"], case["want"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), what
    _close(got["logprobs"], want["logprobs"], f"{what} logprobs")
    _close(got["entropy"], want["entropy"], f"{what} entropy")
    assert got["grads"].keys() == want["grads"].keys(), what
    assert sum(float(g.abs().sum()) for g in want["grads"].values()) > 0
    for name, g in want["grads"].items():
        _close(got["grads"][name], g, f"{what} grad {name}")
    assert got["norm"] == pytest.approx(want["norm"], rel=1e-5) and want["norm"] > TP.MAX_NORM, what
    if rank == 0:  # the full state dict is gathered on rank 0: after the clipped SGD step, the same weights
        assert got["state"].keys() == want["state"].keys(), what
        for name, value in want["state"].items():
            _close(got["state"][name], value, f"{what} weight {name} after the step")
    assert got["layouts"] and all(got["layouts"].values()), f"{what}: gradients shaped as their parameters"
    local, vocab = got["local_vocab"]
    assert local * 2 == vocab, f"{what}: the logits stay sharded over the vocabulary"


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_equals_one_process_for_qwen2_llama_qwen3_meta_load_float64_vocab_parallel_logprobs_and_sampling(
        tmp_path):
    W.launch(TP.tp_worker, 2, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"tp{rank}.pt", weights_only=False)
        for kind in ("qwen2_tied", "llama", "qwen3"):
            _same(res[kind], f"rank {rank} {kind}", rank)
        assert res["qwen2_tied"]["got"]["tied"] and not res["llama"]["got"]["tied"]
        meta = res["meta"]
        assert meta["tied"]
        for got, want, what in zip(meta["got"], meta["want"], ("logprobs", "entropy"), strict=True):
            _close(got, want, f"rank {rank} meta-built, loaded from rank 0: {what}")
        want_lp, want_ent, want_grad = res["float64"]["want"]
        assert want_lp.isfinite().all() and want_ent.isfinite().all() and want_grad.isfinite().all()
        for name in ("local", "dtensor"):
            lp, ent, grad = res["float64"][name]
            torch.testing.assert_close(lp, want_lp, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
        sampled = res["sampler"]
        for temperature, (want_ids, want_lp) in sampled["want"].items():
            got_ids, got_lp = sampled["got"][temperature]
            assert torch.equal(got_ids, want_ids), f"rank {rank}: TP sampled other tokens at T={temperature}"
            _close(got_lp, want_lp, f"rank {rank} sampler log-probs at T={temperature}")
        assert not torch.equal(sampled["want"][0.0][0], sampled["want"][1.0][0])  # temperature 1 did sample
        _read_its_shards(res["deferred"], rank, at_most=0.7)  # row-wise weights: whole rows, then its columns


@pytest.mark.dist
@pytest.mark.slow
def test_tp2_by_fsdp_dp2_equals_one_process(tmp_path):
    W.launch(TP.dp_tp_worker, 4, str(tmp_path))
    coords = set()
    for rank in range(4):
        res = torch.load(tmp_path / f"dptp{rank}.pt", weights_only=False)
        coords.add(res["coords"])
        for kind in ("qwen2_tied", "llama", "qwen3"):
            _same(res[kind], f"rank {rank} {kind}", rank)
        _read_its_shards(res["deferred"], rank, at_most=0.4)
    assert coords == {(0, 0), (0, 1), (1, 0), (1, 1)}


def _read_its_shards(case: dict, rank: int, at_most: float) -> None:
    """A sharded start-up's split model holds the weights from_pretrained loads, and each rank read only part
    of the file."""
    assert 0 < case["read"] <= at_most, f"rank {rank} read {case['read']:.0%} of the weights file"
    if rank == 0:
        want = TP.build("qwen2_tied").state_dict()
        assert case["state"].keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(case["state"][name], value), f"{name} read from the file"


def _qwen2(**overrides) -> Qwen2Config:
    return Qwen2Config(**{"vocab_size": 768, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, **overrides})


def test_divisible_sizes_pass():
    check_tensor_parallel(_qwen2(), 1)
    check_tensor_parallel(_qwen2(), 2)


def test_kv_heads_not_divisible_names_the_value_and_the_fix():
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(_qwen2(), 4)
    msg = str(err.value)
    assert "config.num_key_value_heads=2 is not divisible by the tensor-parallel size 4" in msg
    assert "num_attention_heads" not in msg.split("Fix")[0]
    assert "Fix: use a tensor-parallel size that divides all of them ([1, 2])" in msg


def test_every_indivisible_size_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(_qwen2(num_attention_heads=3, num_key_value_heads=3, intermediate_size=65,
                                     vocab_size=771), 2)
    msg = str(err.value)
    for key, value in (("num_attention_heads", 3), ("num_key_value_heads", 3), ("intermediate_size", 65),
                       ("vocab_size", 771)):
        assert f"config.{key}={value} is not divisible by the tensor-parallel size 2" in msg
    assert "([1])" in msg


def test_unsupported_model_type_and_bad_size():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    check_tensor_parallel(cfg, 4)
    cfg.model_type = "gpt2"
    with pytest.raises(ConfigError, match=r"supports model types qwen2, qwen3, llama, not 'gpt2'.*size to 1"):
        check_tensor_parallel(cfg, 2)
    with pytest.raises(ConfigError, match="must be >= 1"):
        check_tensor_parallel(_qwen2(), 0)


def test_plan_names_every_projection_and_keeps_the_logits_sharded():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from verl.distributed.tensor_parallel import tp_plan

    plan = tp_plan(TP.build("qwen3"))
    layer = "model.layers.1."
    assert {k for k, v in plan.items() if isinstance(v, ColwiseParallel) and k.startswith(layer)} == {
        layer + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert {k for k, v in plan.items() if isinstance(v, RowwiseParallel) and k.startswith(layer)} == {
        layer + "self_attn.o_proj", layer + "mlp.down_proj"}
    assert isinstance(plan[layer + "self_attn.q_norm"], SequenceParallel)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    head = plan["lm_head"]
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert len(plan) == 1 + 2 * 9 + 1


def test_vocab_parallel_logprobs_refuses_a_local_shard_without_its_group_and_a_zero_temperature():
    from verl.distributed.tensor_parallel import vocab_parallel_logprobs

    with pytest.raises(ValueError, match="without tp_group"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature > 0"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0.0)
