"""The decode step's weight layout (transposed projections, F.rms_norm's bits as one layer-norm kernel),
reused only while the weights are unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.rollout.conftest import left_padded, make_model
from tests.rollout.test_hf_engine import LENGTHS, hf_greedy
from verl.rollout import HFKVCacheEngine, SamplingParams, fast_decode
from verl.rollout.fast_decode import (
    LlamaStyleDecodeStep,
    _add_projection,
    _decode_linear,
    _rms_norm,
    _RMSNormAsLayerNorm,
)
from verl.utils.cpu_matmul import OneDNNLinear, onednn_available, use_cpu_matmul


@pytest.mark.parametrize("rows", [1, 3, 5, 16, 40])
def test_transposed_projection_equals_f_linear_up_to_float32_rounding(rows):
    torch.manual_seed(0)
    q, k = torch.nn.Linear(256, 256), torch.nn.Linear(256, 128)
    lin = _decode_linear([q, k])
    assert lin.kernel == "mm" and lin.weight.shape == (256, 384) and lin.weight.is_contiguous()
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        got = lin(x)
        want = torch.cat([q(x), k(x)], dim=-1)
    # float64 reference: both float32 results sit within float32 rounding of the exact product.
    exact = torch.cat([F.linear(x.double(), m.weight.double(), m.bias.double()) for m in (q, k)], dim=-1)
    assert torch.allclose(got.double(), exact, rtol=0, atol=1e-5)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)


def test_the_residual_add_rides_in_the_projections_addmm():
    torch.manual_seed(0)
    no_bias, with_bias = torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(64, 48)
    x, residual = torch.randn(7, 64), torch.randn(7, 48)
    with torch.inference_mode():
        for module in (no_bias, with_bias):
            lin = _decode_linear([module])
            torch.testing.assert_close(_add_projection(lin, residual, x), residual + module(x), rtol=1e-6, atol=1e-6)
        # a module that is not in decode layout (LoRA, quantised) is called as it is
        torch.testing.assert_close(_add_projection(with_bias, residual, x), residual + with_bias(x))


def test_float64_projections_are_not_transposed_and_give_f_linear_bits():
    lin = _decode_linear([torch.nn.Linear(64, 32).double()])
    assert lin.kernel == "linear"
    x = torch.randn(4, 64, dtype=torch.float64)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_float32_decode_step_runs_on_transposed_weights():
    model = make_model("qwen2", seed=1)
    step = LlamaStyleDecodeStep(model)
    with torch.inference_mode():
        step.prepare(32, torch.device("cpu"), torch.float32)
    projections = [lin for plan in step.plans for lin in (plan.qkv, plan.o, plan.gate_up, plan.down)]
    assert all(lin.kernel == "mm" for lin in projections + [step.lm_head])


def test_greedy_equals_hf_generate_in_float64():
    """float64 takes F.linear (no transposed copy) and the module's own RMS norm."""
    model = make_model("llama", seed=3).double()
    ids, mask = left_padded(LENGTHS, seed=6)
    engine = HFKVCacheEngine(model)
    assert engine.fast_decode_reason == ""
    out = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=10))
    assert torch.equal(out.response_ids, hf_greedy(model, ids, mask, 10, [], pad=0))


def test_weights_changed_between_rollouts_without_a_version_bump_are_used():
    """Fused AdamW updates parameters without bumping their version counters, so the layout is checked
    against the values it was built from, not cached on versions."""
    model = make_model("qwen2", seed=5)
    ids, mask = left_padded(LENGTHS, seed=7)
    engine = HFKVCacheEngine(model)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    before = engine.generate(ids, mask, params).response_ids
    layout = engine._decode_step.plans[0].gate_up
    assert torch.equal(engine.generate(ids, mask, params).response_ids, before)
    assert engine._decode_step.plans[0].gate_up is layout  # unchanged weights: the layout is reused
    versions = [p._version for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions  # the trap a version-keyed cache falls into
    after = engine.generate(ids, mask, params).response_ids
    want = hf_greedy(model, ids, mask, 8, [], pad=0)
    assert not torch.equal(want, before)
    assert torch.equal(after, want)
    # same parameters, new values: the layout is rewritten in place, not reallocated
    assert engine._decode_step.plans[0].gate_up is layout
    assert torch.equal(layout.weight, torch.cat([model.model.layers[0].mlp.gate_proj.weight,
                                                 model.model.layers[0].mlp.up_proj.weight]).t())
    # A second step: the copy the layout is checked against was rewritten in place, not aliased.
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    again = hf_greedy(model, ids, mask, 8, [], pad=0)
    assert not torch.equal(again, after)
    assert torch.equal(engine.generate(ids, mask, params).response_ids, again)


def test_a_replaced_parameter_is_used():
    model = make_model("llama", seed=6)
    ids, mask = left_padded(LENGTHS, seed=8)
    engine = HFKVCacheEngine(model)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    before = engine.generate(ids, mask, params).response_ids
    layer = model.model.layers[0].mlp
    layer.down_proj.weight = torch.nn.Parameter(torch.randn_like(layer.down_proj.weight))
    want = hf_greedy(model, ids, mask, 8, [], pad=0)
    assert not torch.equal(want, before)
    assert torch.equal(engine.generate(ids, mask, params).response_ids, want)


class _OnePlusWeightNorm(torch.nn.Module):
    """A Gemma-style RMSNorm (scale 1 + weight): same attributes as Llama's, different formula."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


def test_rms_norm_shortcut_only_where_f_rms_norm_gives_the_module_bits():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    x = torch.randn(5, 64)
    llama_style = Qwen2RMSNorm(64)
    with torch.no_grad():
        llama_style.weight.normal_()
    fast32 = _rms_norm(llama_style, torch.float32)  # F.rms_norm gives its bits; on CPU float32: the layer-norm form
    assert isinstance(fast32, _RMSNormAsLayerNorm)
    torch.testing.assert_close(fast32(x), llama_style(x), rtol=1e-6, atol=1e-6)
    other = _OnePlusWeightNorm(64)
    assert _rms_norm(other, torch.float32) is other


@pytest.mark.parametrize("offset", [0.0, 50.0])
def test_rms_norm_as_layer_norm_equals_the_float64_rms_norm(offset):
    """layer_norm([x, -x]) subtracts a mean that is 0 up to rounding, also for inputs far from zero mean."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(16, 96, generator=g) * 3 + offset, torch.randn(96, generator=g)
    got = _RMSNormAsLayerNorm(weight, 1e-6)(x)
    want = F.rms_norm(x.double(), (96,), weight.double(), 1e-6)
    assert got.shape == (16, 96)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)


def test_a_model_cast_between_rollouts_is_used():
    model = make_model("qwen2", seed=9)
    ids, mask = left_padded(LENGTHS, seed=10)
    engine = HFKVCacheEngine(model)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    engine.generate(ids, mask, params)
    model.double()
    out = engine.generate(ids, mask, params)
    assert engine._decode_step.plans[0].qkv.weight.dtype == torch.float64
    assert torch.equal(out.response_ids, hf_greedy(model, ids, mask, 8, [], pad=0))


def test_silu_runs_in_place_on_the_gate_output_and_other_activations_as_they_are():
    from transformers.activations import ACT2FN

    from verl.rollout.fast_decode import _activation, _in_place_silu

    assert _activation(ACT2FN["silu"]) is _in_place_silu
    assert _activation(torch.nn.SiLU()) is _in_place_silu
    gelu = ACT2FN["gelu"]
    assert _activation(gelu) is gelu
    x = torch.randn(4, 8)
    expected = F.silu(x)
    assert _in_place_silu(x) is x and torch.equal(x, expected)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
def test_onednn_layers_decode_in_onednn_layout_and_follow_weight_changes(monkeypatch):
    """`trainer.cpu_matmul=onednn` models keep [out, in] fused weights, packed for oneDNN, repacked after a
    weight change; the tokens are the model's own."""
    monkeypatch.setattr(fast_decode, "MIN_PACKED_ELEMENTS", 0)  # this model's weights are all small
    model = use_cpu_matmul(make_model("qwen2", seed=2), "onednn")
    ids, mask = left_padded(LENGTHS, seed=9)
    engine = HFKVCacheEngine(model)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    before = engine.generate(ids, mask, params).response_ids
    step = engine._decode_step
    assert all(lin.kernel == "onednn" for plan in step.plans for lin in (plan.qkv, plan.o, plan.gate_up, plan.down))
    assert torch.equal(before, hf_greedy(model, ids, mask, 8, [], pad=0))
    gate_up = step.plans[1].gate_up
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = engine.generate(ids, mask, params).response_ids
    assert step.plans[1].gate_up is gate_up  # rewritten in place
    mlp = model.model.layers[1].mlp
    assert torch.equal(gate_up.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert not torch.equal(after, before) and torch.equal(after, hf_greedy(model, ids, mask, 8, [], pad=0))


def test_small_onednn_layers_decode_as_mm():
    """Under MIN_PACKED_ELEMENTS a oneDNN call costs more than MKL's mm on a transposed copy."""
    small, large = OneDNNLinear(64, 128), OneDNNLinear(256, 256)
    assert small.weight.numel() < fast_decode.MIN_PACKED_ELEMENTS <= large.weight.numel()
    assert _decode_linear([small]).kernel == "mm" and _decode_linear([large]).kernel == "onednn"


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("rows", [2, 40])  # under and over oneDNN's size
def test_onednn_projection_and_its_residual_add_equal_float64(rows):
    torch.manual_seed(0)
    q, k = OneDNNLinear(256, 256, bias=False), OneDNNLinear(256, 128, bias=False)
    lin = _decode_linear([q, k])
    assert lin.kernel == "onednn" and lin.weight.shape == (384, 256)
    x, residual = torch.randn(rows, 256), torch.randn(rows, 384)
    exact = torch.cat([F.linear(x.double(), m.weight.double()) for m in (q, k)], dim=-1)
    with torch.inference_mode():
        assert torch.allclose(lin(x).double(), exact, rtol=0, atol=1e-5)
        assert torch.allclose(_add_projection(lin, residual, x).double(), residual.double() + exact, rtol=0, atol=1e-5)


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group in this process: enough for FSDP2 to shard (onto one rank) and hook a model."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_model_decodes_on_the_fast_step_while_its_weights_are_gathered(one_rank_group):
    from verl.distributed.fsdp import apply_fsdp, gathered
    from verl.trainer.fsdp_config import FSDPConfig

    ids, mask = left_padded(LENGTHS, seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    want = HFKVCacheEngine(make_model("qwen2")).generate(ids, mask, params).response_ids
    model = apply_fsdp(make_model("qwen2"), FSDPConfig(), group=one_rank_group, device_type="cpu")
    engine = HFKVCacheEngine(model)
    assert "sharded" in engine.fast_decode_reason  # outside a rollout the weights are shards
    with gathered(model):
        assert engine.fast_decode_reason == ""
        calls = []
        real = LlamaStyleDecodeStep.__call__
        LlamaStyleDecodeStep.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
        try:
            got = engine.generate(ids, mask, params).response_ids
        finally:
            LlamaStyleDecodeStep.__call__ = real
    assert len(calls) == 7 and torch.equal(got, want)
    assert "sharded" in engine.fast_decode_reason


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("speedup,kernel", [(2.0, "onednn"), (1.0, "mm")])
def test_auto_decodes_plain_layers_on_the_library_its_measurement_picks(monkeypatch, tmp_path, speedup, kernel):
    """Under `trainer.cpu_matmul=auto` the decode step times its own projections (at the rollout's rows) and keeps
    the faster library for them; either way the tokens are the model's own."""
    from verl.utils import cpu_matmul

    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VERL_CPU_MATMUL", raising=False)
    monkeypatch.setattr(fast_decode, "MIN_PACKED_ELEMENTS", 0)  # this model's weights are all small
    asked = []
    monkeypatch.setattr(cpu_matmul, "measured_decode_speedup", lambda rows, layout: asked.append((rows, layout))
                        or speedup)
    cpu_matmul.decode_speedup.cache_clear()
    model = make_model("qwen2", seed=2)
    ids, mask = left_padded(LENGTHS, seed=9)
    engine = HFKVCacheEngine(model, cpu_matmul="auto")
    try:
        got = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=8)).response_ids
        engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=8))
    finally:
        cpu_matmul.decode_speedup.cache_clear()
    assert len(asked) == 1 and asked[0][0] == ids.shape[0]  # once, at the rollout's rows
    layers = model.config.num_hidden_layers
    assert len(asked[0][1]) == 4 * layers + 1  # q/k/v, o, gate/up, down per layer, and the lm_head
    step = engine._decode_step
    assert all(lin.kernel == kernel for plan in step.plans for lin in (plan.qkv, plan.o, plan.gate_up, plan.down))
    assert engine.decode_matmul[0] == ("onednn" if kernel == "onednn" else "aten")
    assert torch.equal(got, hf_greedy(model, ids, mask, 8, [], pad=0))


def test_a_set_library_decodes_without_measuring(monkeypatch):
    from verl.utils import cpu_matmul

    monkeypatch.setattr(cpu_matmul, "measured_decode_speedup", lambda *_: pytest.fail("measured"))
    engine = HFKVCacheEngine(make_model("qwen2", seed=2), cpu_matmul="aten")
    ids, mask = left_padded(LENGTHS, seed=9)
    engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=4))
    assert engine.decode_matmul == ("aten", "as set")
    assert all(plan.gate_up.kernel == "mm" for plan in engine._decode_step.plans)
