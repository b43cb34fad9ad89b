"""oneDNN linear layers (`trainer.cpu_matmul`): the same forward and gradients as float64 math, chosen by
processor and shape only, and invisible to everything that looks at the modules."""

from __future__ import annotations

import copy
import json

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
        monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda s=speedup, **_: s)
        got, why = resolve("auto")
        assert got == library and f"oneDNN {speedup:.2f}x" in why
    assert resolve("aten")[0] == "aten" and resolve("onednn")[0] == "onednn"

    cpu_matmul.host_speedup.cache_clear()  # a new process: reads the host's value, does not measure
    monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda **_: pytest.fail("measured twice"))
    assert resolve("auto")[0] == "aten" and cpu_matmul.host_speedup() == 0.6
    cpu_matmul.host_speedup.cache_clear()


@needs_onednn
def test_the_measurement_times_both_libraries():
    speedup = cpu_matmul.measured_speedup(repeats=1)
    assert 0.05 < speedup < 20


def test_the_measurement_is_each_products_undisturbed_time_weighted(monkeypatch):
    """A burst of load slows the repeats it hits, never speeds one up: each product's fastest repeat per
    library is its time, so bursts on either side leave the result alone; the libraries go first in turn, and a
    product's weight (its layers, its cut rows) scales its time."""
    calls, clock = [], {"t": 0.0}
    cost = {"aten": {4: 1.0, 8: 3.0}, "onednn": {4: 0.5, 8: 3.0}}  # seconds per call, by the product's rows

    def product(name):
        def run(a, b):
            calls.append(name)
            burst = 50.0 if len(calls) % 7 == 0 else 1.0  # every 7th call, on either side, under load
            clock["t"] += cost[name][a.shape[0]] * burst  # forward products: a is [rows, in]
        return run

    monkeypatch.setattr(cpu_matmul.F, "linear", product("aten"))
    monkeypatch.setattr(cpu_matmul, "_onednn", product("onednn"))
    monkeypatch.setattr(cpu_matmul.time, "perf_counter", lambda: clock["t"])
    products = ((4, 16, 32, False, 2.0), (8, 16, 32, False, 1.0))
    assert cpu_matmul.measured_speedup(repeats=9, products=products) == pytest.approx((2 * 1.0 + 3.0) / (2 * 0.5 + 3.0))
    assert calls[:4] == ["onednn", "aten", "aten", "onednn"]


def test_the_environment_variable_decides_auto_for_a_whole_session(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda **_: pytest.fail("a forced kernel measures nothing"))
    monkeypatch.setattr(cpu_matmul, "host_speedup", lambda *_: pytest.fail("a forced kernel measures nothing"))
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
    monkeypatch.setattr(cpu_matmul, "measured_speedup", lambda **_: 1.8)
    monkeypatch.setattr(cpu_matmul, "cpu_model", lambda: "AMD EPYC 9B14")
    cpu_matmul.host_speedup.cache_clear()
    name, status, note = doctor._cpu_matmul_row()
    cpu_matmul.host_speedup.cache_clear()
    assert (name, status) == ("cpu matmul", "ok")
    assert note == ("AMD EPYC 9B14: trainer.cpu_matmul=auto uses oneDNN (measured on this host on a 10M model's "
                    "layers: oneDNN 1.80x ATen's speed, auto takes oneDNN from 1.3x)")


def test_a_run_times_its_own_layers_at_its_own_rows():
    """auto measures what the run multiplies: each distinct layer shape once, weighted by how many layers have
    it, at a training micro-batch's tokens (forward and backward) and a decode step's rows; products too small
    for oneDNN are left out, and a large layer's rows are cut with the weight scaling its time back up."""
    from verl.config import load_config
    from verl.trainer.build.models import run_products

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(64, 256), torch.nn.Linear(8, 8),
                                torch.nn.Linear(4096, 8192))
    products = cpu_matmul.model_products(model, update_rows=512, decode_rows=16)
    assert (512, 64, 256, True, 2.0) in products and not any(p[:3] == (16, 64, 256) for p in products)  # < MIN_MACS
    assert not any(p[1:3] == (8, 8) for p in products)
    cut = [p for p in products if p[1:3] == (4096, 8192)]
    assert [(rows, backward) for rows, *_, backward, _ in cut] == [(2, True), (2, False)]  # 2 x 4096 x 8192 = 2^26
    assert [weight for *_, weight in cut] == [256.0, 8.0]  # 512 and 16 rows' worth of time
    config = load_config(overrides=["data.max_prompt_length=100", "rollout.max_new_tokens=28",
                                    "actor.micro_batch_size=4", "data.train_batch_size=8", "rollout.n=4"])
    assert run_products(config, model) == cpu_matmul.model_products(model, 4 * 128, 32)
    budget = load_config(overrides=["actor.max_tokens_per_micro_batch=2048", "trainer.kind=sft"])
    assert run_products(budget, model) == cpu_matmul.model_products(model, 2048, 0)


def test_check_and_the_summary_name_the_choice_made_on_the_runs_layers(monkeypatch, tmp_path, capsys):
    from verl.cli.main import main
    from verl.trainer.rl_trainer import RLTrainer

    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VERL_CPU_MATMUL", raising=False)
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: True)
    timed = []

    def measured(repeats=7, products=cpu_matmul.TIMED_PRODUCTS):
        timed.append(products)
        return 0.7 if products == cpu_matmul.TIMED_PRODUCTS else 1.6  # a 10M model's layers would say aten

    monkeypatch.setattr(cpu_matmul, "measured_speedup", measured)
    cpu_matmul.host_speedup.cache_clear()
    from tiny_support import tiny_run_config

    config = tiny_run_config(tmp_path / "run", "actor.micro_batch_size=64", "rollout.max_new_tokens=64",
                             "data.max_prompt_length=64", "trainer.total_steps=1", "env.name=arithmetic",
                             "reward.functions=[{name: numeric_match}]")
    path = tmp_path / "run.yaml"
    from verl.config.loader import config_to_yaml

    path.write_text(config_to_yaml(config))
    try:
        assert main(["check", str(path)]) == 0
        trainer = RLTrainer(config)
        summary = json.loads(trainer.write_summary({}).read_text())
    finally:
        cpu_matmul.host_speedup.cache_clear()
    assert len(set(timed)) == 1 and timed[0] != cpu_matmul.TIMED_PRODUCTS  # measured once, on the run's layers
    why = "measured on this host on this run's layers: oneDNN 1.60x ATen's speed"
    assert f"linear layers on CPU: oneDNN (trainer.cpu_matmul=auto: {why}" in capsys.readouterr().out
    assert summary["cpu_matmul"] == "onednn" and why in summary["cpu_matmul_why"]
    assert any(type(m) is OneDNNLinear for m in trainer.model.modules())
    assert "cpu_matmul_decode" not in summary  # no rollout yet
    from verl.rollout import fast_decode

    monkeypatch.setattr(fast_decode, "MIN_PACKED_ELEMENTS", 0)  # this model's weights are all small
    monkeypatch.setattr(cpu_matmul, "measured_decode_speedup", lambda *_: pytest.fail("nothing to measure"))
    trainer.step()  # oneDNN layers decode packed: nothing for the decode to measure
    summary = json.loads(trainer.write_summary({}).read_text())
    assert summary["cpu_matmul_decode"] == "onednn" and "oneDNN's" in summary["cpu_matmul_decode_why"]


def test_the_decode_step_chooses_apart_only_under_auto(monkeypatch, tmp_path):
    """`aten`/`onednn` (set, or forced by the environment) keep the decode on the run's library without
    measuring; `auto` follows the decode measurement with the same margin, kept on disk for later processes."""
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: True)
    monkeypatch.delenv("VERL_CPU_MATMUL", raising=False)
    layout = ((256, 512), (1024, 256))
    monkeypatch.setattr(cpu_matmul, "measured_decode_speedup", lambda *_: pytest.fail("a set kernel measures nothing"))
    assert cpu_matmul.resolve_decode("aten", 16, layout) == ("aten", "as set")
    assert cpu_matmul.resolve_decode("onednn", 16, layout) == ("onednn", "as set")
    monkeypatch.setenv("VERL_CPU_MATMUL", "aten")
    assert cpu_matmul.resolve_decode("auto", 16, layout)[0] == "aten"
    monkeypatch.delenv("VERL_CPU_MATMUL")
    assert cpu_matmul.resolve_decode("auto", 16, ())[0] == "aten"  # nothing to choose for

    for speedup, library in ((1.45, "onednn"), (1.25, "aten"), (0.5, "aten")):
        cpu_matmul.decode_speedup.cache_clear()
        for stale in tmp_path.rglob("*.json"):
            stale.unlink()
        monkeypatch.setattr(cpu_matmul, "measured_decode_speedup", lambda rows, lay, s=speedup: s)
        got, why = cpu_matmul.resolve_decode("auto", 16, layout)
        assert got == library and f"{speedup:.2f}x" in why and "16 rows" in why
    cpu_matmul.decode_speedup.cache_clear()  # a new process: reads the kept value
    monkeypatch.setattr(cpu_matmul, "measured_decode_speedup", lambda *_: pytest.fail("measured twice"))
    assert cpu_matmul.resolve_decode("auto", 16, layout)[0] == "aten"
    cpu_matmul.decode_speedup.cache_clear()


@needs_onednn
def test_the_decode_measurement_times_weights_in_turn_up_to_its_byte_cap(monkeypatch):
    made = []
    real = torch.randn

    def randn(*shape, **kwargs):
        made.append(shape)
        return real(*shape, **kwargs)

    monkeypatch.setattr(cpu_matmul, "MAX_DECODE_TIMED_BYTES", 3 * 4 * 256 * 256)
    monkeypatch.setattr(cpu_matmul.torch, "randn", randn)
    speedup = cpu_matmul.measured_decode_speedup(4, ((256, 256),) * 5, repeats=1)
    assert 0.05 < speedup < 20
    assert made.count((256, 256)) == 3  # the first three weights fit the cap; the rest would only repeat them
