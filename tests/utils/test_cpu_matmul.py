"""oneDNN linear layers (`trainer.cpu_matmul`): the same forward and gradients as float64 math, chosen by
processor and shape only, and invisible to everything that looks at the modules."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from verl.errors import ConfigError
from verl.utils import cpu_matmul
from verl.utils.cpu_matmul import (
    MIN_MACS,
    OneDNNLinear,
    onednn_available,
    onednn_linear,
    resolve,
    use_cpu_matmul,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear")


def _float64_linear_grads(x, weight, bias, grad_out):
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    out = F.linear(x64, w64, b64)
    out.backward(grad_out.double())
    return out, x64.grad, w64.grad, None if b64 is None else b64.grad


@needs_onednn
@pytest.mark.parametrize("shape", [(512, 256), (4, 124, 256), (3, 5, 16)])  # 2-D, 3-D, under MIN_MACS
@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_and_every_gradient_equal_float64(shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    fan_in, fan_out = shape[-1], 384
    x = torch.randn(*shape, generator=generator).requires_grad_()
    weight = (torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5).requires_grad_()
    bias = torch.randn(fan_out, generator=generator).requires_grad_() if with_bias else None
    grad_out = torch.randn(*shape[:-1], fan_out, generator=generator)
    out = onednn_linear(x, weight, bias)
    out.backward(grad_out)
    want, want_x, want_w, want_b = _float64_linear_grads(x, weight, bias, grad_out)
    for got, exact in ((out, want), (x.grad, want_x), (weight.grad, want_w),
                       (bias.grad if with_bias else None, want_b)):
        if exact is not None:
            scale = exact.abs().max().item()
            assert (got.double() - exact).abs().max().item() <= 1e-5 * scale


@needs_onednn
def test_a_transposed_input_and_a_frozen_weight():
    """Non-contiguous activations are read as they are; a frozen weight (LoRA's base) gets no gradient."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 600, generator=generator).t().requires_grad_()  # [600, 256], not contiguous
    weight = torch.randn(128, 256, generator=generator)
    out = onednn_linear(x, weight)
    out.sum().backward()
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(x.grad, torch.ones(600, 128) @ weight, rtol=1e-5, atol=1e-4)
    assert weight.grad is None


def test_other_dtypes_and_small_products_take_f_linear_bits():
    generator = torch.Generator().manual_seed(2)
    x64, w64 = torch.randn(8, 64, dtype=torch.float64, generator=generator), torch.randn(32, 64, dtype=torch.float64)
    assert torch.equal(onednn_linear(x64, w64), F.linear(x64, w64))
    x, weight = torch.randn(4, 32, generator=generator), torch.randn(16, 32, generator=generator)
    assert 4 * 32 * 16 < MIN_MACS and torch.equal(onednn_linear(x, weight), F.linear(x, weight))
    assert onednn_linear(torch.empty(0, 32), weight).shape == (0, 16)


def test_the_swap_changes_the_class_only_and_copies_keep_it():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    use_cpu_matmul(model, "onednn")
    assert [type(m) for m in model if isinstance(m, torch.nn.Linear)] == [OneDNNLinear, OneDNNLinear]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert type(copy.deepcopy(model)[2]) is OneDNNLinear
    use_cpu_matmul(model, "aten")
    assert [type(m) for m in model if isinstance(m, torch.nn.Linear)] == [torch.nn.Linear, torch.nn.Linear]


def test_auto_takes_the_library_measured_faster_on_this_host_once(monkeypatch, tmp_path):
    """auto follows the measurement, with a margin; the first measurement on a host is kept on disk and read
    by every later process (a rank, the next run) instead of measuring again."""
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: True)
    monkeypatch.delenv("VERL_CPU_MATMUL", raising=False)
    for speedup, library in ((1.8, "onednn"), (1.25, "aten"), (1.05, "aten"), (0.6, "aten")):
        cpu_matmul.host_speedup.cache_clear()
        for stale in tmp_path.rglob("*.json"):
            stale.unlink()
        monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda s=speedup: s)
        got, why = resolve("auto")
        assert got == library and f"oneDNN {speedup:.2f}x" in why
    assert resolve("aten")[0] == "aten" and resolve("onednn")[0] == "onednn"

    cpu_matmul.host_speedup.cache_clear()  # a new process: reads the host's value, does not measure
    monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda: pytest.fail("measured twice"))
    assert resolve("auto")[0] == "aten" and cpu_matmul.host_speedup() == 0.6
    cpu_matmul.host_speedup.cache_clear()


@needs_onednn
def test_the_measurement_times_both_libraries():
    speedup = cpu_matmul.measured_speedup(repeats=1)
    assert 0.05 < speedup < 20


def test_the_measurement_is_the_median_of_interleaved_rounds(monkeypatch):
    """A burst of load on one side of one round moves that round's ratio, not the result: the median of the
    rounds' ratios is taken, and each round times both libraries back to back, the first side in turn."""
    calls, clock = [], {"t": 0.0}
    per_side = sum(3 if backward else 1 for *_, backward in cpu_matmul.TIMED_PRODUCTS)

    def product(name):
        def run(a, b):
            calls.append(name)
            burst = 50.0 if (len(calls) - 1) // per_side == 6 else 1.0  # round 3's first side, under load
            clock["t"] += (1.0 if name == "aten" else 0.5) * burst
        return run

    monkeypatch.setattr(cpu_matmul.F, "linear", product("aten"))
    monkeypatch.setattr(cpu_matmul, "_onednn", product("onednn"))
    monkeypatch.setattr(cpu_matmul.time, "perf_counter", lambda: clock["t"])
    assert cpu_matmul.measured_speedup(repeats=7) == pytest.approx(2.0)
    assert calls[::per_side][:4] == ["onednn", "aten", "aten", "onednn"]


def test_the_environment_variable_decides_auto_for_a_whole_session(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda: pytest.fail("a forced kernel measures nothing"))
    monkeypatch.setattr(cpu_matmul, "host_speedup", lambda: pytest.fail("a forced kernel measures nothing"))
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: True)
    for value, library in (("aten", "aten"), ("onednn", "onednn"), (" OneDNN ", "onednn")):
        monkeypatch.setenv("VERL_CPU_MATMUL", value)
        assert resolve("auto") == (library, f"set by VERL_CPU_MATMUL={library}")
        assert cpu_matmul.describe("auto") == (f"linear layers on CPU: {cpu_matmul.LIBRARY_NAMES[library]} "
                                               f"(trainer.cpu_matmul=auto: set by VERL_CPU_MATMUL={library})")
    monkeypatch.setenv("VERL_CPU_MATMUL", "onednn")
    assert resolve("aten") == ("aten", "as set")  # a config that names its kernel keeps it
    monkeypatch.setenv("VERL_CPU_MATMUL", "mkl")
    with pytest.raises(ConfigError, match=r"VERL_CPU_MATMUL='mkl' names no CPU matmul library; set it to aten "
                                          r"or onednn, or unset it"):
        resolve("auto")
    monkeypatch.setenv("VERL_CPU_MATMUL", "onednn")
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match=r"VERL_CPU_MATMUL=onednn, but this torch build has no oneDNN linear"):
        resolve("auto")


def test_forcing_onednn_without_it_names_the_fix(monkeypatch):
    monkeypatch.delenv("VERL_CPU_MATMUL", raising=False)
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: False)
    assert resolve("auto")[0] == "aten"
    with pytest.raises(ConfigError, match="trainer.cpu_matmul=onednn.*set trainer.cpu_matmul=auto or aten"):
        resolve("onednn")


@needs_onednn
def test_a_decoder_trains_to_the_same_loss_and_gradients_on_either_library():
    """A whole causal LM: loss and every parameter's gradient agree to float32 rounding."""
    from tests.rollout.conftest import make_model

    model = make_model("qwen2", seed=4)
    other = use_cpu_matmul(copy.deepcopy(model), "onednn")
    ids = torch.randint(0, 300, (8, 40), generator=torch.Generator().manual_seed(3))  # 320 rows: oneDNN's size
    grads = []
    for m in (model, other):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_doctor_names_the_library_auto_takes_here_and_why(monkeypatch, tmp_path):
    from verl.cli import doctor

    monkeypatch.delenv("VERL_CPU_MATMUL", raising=False)
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: True)
    monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda: 1.8)
    monkeypatch.setattr(cpu_matmul, "cpu_model", lambda: "AMD EPYC 9B14")
    cpu_matmul.host_speedup.cache_clear()
    name, status, note = doctor._cpu_matmul_row()
    cpu_matmul.host_speedup.cache_clear()
    assert (name, status) == ("cpu matmul", "ok")
    assert note == ("AMD EPYC 9B14: trainer.cpu_matmul=auto uses oneDNN (measured on this host: oneDNN 1.80x ATen's "
                    "speed, auto takes oneDNN from 1.3x)")
