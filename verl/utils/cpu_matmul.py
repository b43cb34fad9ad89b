"""Which library multiplies a linear layer's matrices on CPU in float32: ATen's BLAS (MKL) or oneDNN.

Both ship inside the torch wheel. MKL takes a generic code path on some AMD processors, so there it runs float32
products at about half the speed oneDNN reaches on the same core; on others the two are close (the
`benchmarks/cpu_matmul.py` rows in docs/performance.md). Which one wins depends on the processor and the torch
build, so nothing is assumed: `trainer.cpu_matmul` `auto` times both on this host on the products the run multiplies
(:func:`model_products`: each distinct shape of its model's linear layers at a training micro-batch's tokens, forward
and backward, and at a decode step's rows; :func:`measured_speedup`: each product's fastest of interleaved repeats per
library, the undisturbed time even on a busy machine) and takes oneDNN only where it is at least :data:`AUTO_MARGIN`
times faster: a near tie keeps ATen, so a noisy measurement cannot flip the choice. The measurement is made once per
host, torch version, thread count and set of products and kept in ``$VERL_CACHE_DIR/cpu_matmul/`` (first writer
wins), so every later run of that model and every rank on the host makes the same choice; `aten` or `onednn` force
one, and so does the environment variable ``VERL_CPU_MATMUL`` for every `auto` in its process and children (a whole
test session on one kernel).
A rollout's decode steps decide apart (:func:`resolve_decode`): they multiply a few rows by each weight in turn,
where oneDNN on weights packed once per weight change can win while MKL wins the update's products, or the other
way round; `auto` measures that regime on the run's own decode step, with the same margin and the same keeping.
Outcomes must not depend on the choice: the two libraries round differently, like two batch sizes.

With oneDNN, every plain `nn.Linear` of a model becomes a :class:`OneDNNLinear` (same parameters, same state
dict, still an `nn.Linear`), whose float32 CPU products of at least :data:`MIN_MACS` multiply-adds, forward
and backward, run in oneDNN; smaller ones, other dtypes and other devices take `F.linear` as before, since
oneDNN's fixed cost per call exceeds their arithmetic. The sums are ordered differently, so results differ
from MKL's by float32 rounding, as between batch sizes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from verl.errors import ConfigError

CpuMatmul = Literal["auto", "aten", "onednn"]
LIBRARY_NAMES = {"aten": "ATen (MKL)", "onednn": "oneDNN"}  # how `verl check` and `verl doctor` name them
# Below this many multiply-adds (rows x in x out) a product takes F.linear: oneDNN's per-call cost is larger.
MIN_MACS = 2**21
# auto takes oneDNN only when it is this many times faster: hosts where MKL takes its generic path measure ~2x,
# the others within 10% of 1x, so a margin far from both keeps noise from flipping the choice.
AUTO_MARGIN = 1.3
ENV_VAR = "VERL_CPU_MATMUL"  # aten | onednn: what `auto` means in this process and its children
# What auto times: (rows, in, out, with the two backward products, weight of its time). Without a model (`verl
# doctor`): an update's micro-batch of tokens through a 10M model's largest layers, and a decode step of 4
# prompts x 4 samples. A run times its own model's layers instead (`model_products`).
Product = tuple[int, int, int, bool, float]
TIMED_PRODUCTS: tuple[Product, ...] = ((512, 256, 1024, True, 1.0), (512, 1024, 256, True, 1.0),
                                       (16, 256, 1024, False, 1.0))
# A timed product of a large layer runs fewer rows (its weight scales its time back up): rows past a few
# hundred change a product's speed little, and the measurement stays under a second for a 7B model's layers.
MAX_TIMED_MACS = 2**26
# A decode step's projections, (in, out) each, in the order the step runs them (`resolve_decode`).
DecodeLayout = tuple[tuple[int, int], ...]
# The decode measurement times the first projections up to this many bytes of weights: past the processor's
# caches, the weights it times stream from memory as a whole model's do.
MAX_DECODE_TIMED_BYTES = 64 * 2**20


@cache
def cpu_vendor() -> str:
    """The processor's vendor string (`AuthenticAMD`, `GenuineIntel`, ...), or '' when it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    text = platform.processor()
    return next((v for v in ("AuthenticAMD", "GenuineIntel") if v in text), "")


def cpu_model() -> str:
    """The processor's model name, or '' when it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


@cache
def onednn_available() -> bool:
    """Whether this torch build runs oneDNN's linear on plain float32 weights, agreeing with F.linear."""
    try:
        generator = torch.Generator().manual_seed(0)
        x, weight = torch.randn(3, 8, generator=generator), torch.randn(5, 8, generator=generator)
        out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return torch.allclose(out, F.linear(x, weight), atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


def _forced(setting: CpuMatmul) -> tuple[Literal["aten", "onednn"], str] | None:
    """The library `setting` names without measuring (`aten`, `onednn`, or `auto` under ``VERL_CPU_MATMUL``), or
    None when `auto` is to measure; a library this torch build lacks is a ConfigError."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if setting == "auto" and forced not in ("", "auto"):
        if forced not in LIBRARY_NAMES:
            raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} names no CPU matmul library; "
                              f"set it to aten or onednn, or unset it to let trainer.cpu_matmul=auto measure")
        if forced == "onednn" and not onednn_available():
            raise ConfigError(f"{ENV_VAR}=onednn, but this torch build has no oneDNN linear (torch "
                              f"{torch.__version__}); set it to aten or unset it")
        return forced, f"set by {ENV_VAR}={forced}"  # type: ignore[return-value]
    if setting == "aten":
        return "aten", "as set"
    if not onednn_available():
        why = "this torch build has no oneDNN linear"
        if setting == "onednn":
            raise ConfigError(f"trainer.cpu_matmul=onednn, but {why} (torch {torch.__version__}); "
                              "set trainer.cpu_matmul=auto or aten")
        return "aten", why
    if setting == "onednn":
        return "onednn", "as set"
    return None


def resolve(setting: CpuMatmul, products: tuple[Product, ...] = TIMED_PRODUCTS
            ) -> tuple[Literal["aten", "onednn"], str]:
    """The library `setting` means on this machine for a run that multiplies `products` (`model_products`;
    by default a 10M model's), and why (what `verl check`, `verl doctor`, the banner of every run and the
    demos' summary.json say)."""
    forced = _forced(setting)
    if forced is not None:
        return forced
    if not products:
        return "aten", "no product of this run is large enough for oneDNN"
    speedup = host_speedup(products)
    library = "onednn" if speedup >= AUTO_MARGIN else "aten"
    shapes = "a 10M model's layers" if products == TIMED_PRODUCTS else "this run's layers"
    return library, (f"measured on this host on {shapes}: oneDNN {speedup:.2f}x ATen's speed, "
                     f"auto takes oneDNN from {AUTO_MARGIN:.1f}x")


def resolve_decode(setting: CpuMatmul, rows: int, layout: DecodeLayout) -> tuple[Literal["aten", "onednn"], str]:
    """The library a rollout's decode steps multiply `layout`'s projections with, on `rows` rows, and why.

    `aten` and `onednn` (set, or forced by ``VERL_CPU_MATMUL``) keep the whole run on one library. `auto` measures
    the decode step on its own (:func:`decode_speedup`): it multiplies a few rows by every weight of the model in
    turn, so the weights stream from memory, a regime unlike the update's products, where the libraries can rank
    the other way round; the same margin keeps a near tie on ATen.
    """
    forced = _forced(setting)
    if forced is not None:
        return forced
    if not layout:
        return "aten", "no plain decode projection is large enough for oneDNN"
    speedup = decode_speedup(rows, layout)
    library = "onednn" if speedup >= AUTO_MARGIN else "aten"
    return library, (f"measured on this host on this run's decode step ({rows} rows): oneDNN's packed weights "
                     f"{speedup:.2f}x ATen's speed, auto takes oneDNN from {AUTO_MARGIN:.1f}x")


def describe(setting: CpuMatmul, products: tuple[Product, ...] = TIMED_PRODUCTS) -> str:
    """One line naming the library `setting` runs and why: `verl check` and every CPU run's banner print it."""
    library, why = resolve(setting, products)
    return f"linear layers on CPU: {LIBRARY_NAMES[library]} (trainer.cpu_matmul={setting}: {why})"


def model_products(model: torch.nn.Module, update_rows: int, decode_rows: int) -> tuple[Product, ...]:
    """The products a run of `model` multiplies, for `auto` to time: each distinct (in, out) of its linear
    layers with `update_rows` tokens forward and backward (a training micro-batch) and `decode_rows` forward
    (a decode step), weighted by how many layers have it; only those large enough for oneDNN
    (:data:`MIN_MACS`: smaller ones run `F.linear` on either setting). Rows over :data:`MAX_TIMED_MACS` are
    cut, and the weight scales the time back up."""
    shapes: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    products = []
    for (fan_in, fan_out), count in sorted(shapes.items()):
        for rows, backward in ((update_rows, True), (decode_rows, False)):
            if rows * fan_in * fan_out < MIN_MACS:
                continue
            timed = max(1, min(rows, MAX_TIMED_MACS // (fan_in * fan_out)))
            products.append((timed, fan_in, fan_out, backward, round(count * rows / timed, 3)))
    return tuple(products)


def measured_speedup(repeats: int = 9, products: tuple[Product, ...] = TIMED_PRODUCTS) -> float:
    """How many times faster oneDNN runs `products` than ATen on this machine: each product (forward, and its
    two backward products where it has them) timed `repeats` times on each library in turns, its fastest time
    per library (a run another process interrupted is only ever slower, so the minimum is the undisturbed time,
    stable on a busy machine where the ratio of whole rounds is not), times its weight, summed."""
    generator = torch.Generator().manual_seed(0)
    totals = {"aten": 0.0, "onednn": 0.0}
    sides = (("aten", F.linear), ("onednn", _onednn))
    with torch.no_grad():
        for rows, fan_in, fan_out, backward, weight in products:
            x, w = torch.randn(rows, fan_in, generator=generator), torch.randn(fan_out, fan_in, generator=generator)
            grad = torch.randn(rows, fan_out, generator=generator)
            case = [(x, w)] + ([(grad, w.t()), (grad.t(), x.t())] if backward else [])
            best = {"aten": math.inf, "onednn": math.inf}
            for round_ in range(repeats + 1):  # the first round warms both up (oneDNN builds its primitives)
                for library, product in sides if round_ % 2 else sides[::-1]:  # either side goes first in turn
                    start = time.perf_counter()
                    for a, b in case:
                        product(a, b)
                    if round_:
                        best[library] = min(best[library], time.perf_counter() - start)
            for library in totals:
                totals[library] += weight * best[library]
    return totals["aten"] / max(totals["onednn"], 1e-12)


def measured_decode_speedup(rows: int, layout: DecodeLayout, repeats: int = 9) -> float:
    """How many times faster one decode step's projections (`layout`: (in, out) of each, in the order the step runs
    them) run on oneDNN's prepacked weights than as MKL `mm` on [in, out] copies (the two layouts of
    `verl.rollout.fast_decode`), on `rows` rows. Each projection has its own weight, as in a real step, so every
    product reads a weight the others have pushed out of the cache; a product timed alone on a warm weight measures
    another regime (benchmarks/decode_matmul.py). Weights past :data:`MAX_DECODE_TIMED_BYTES` are left out: the
    ones timed already stream from memory. The fastest of interleaved repeats per side, as in
    :func:`measured_speedup`."""
    generator = torch.Generator().manual_seed(0)
    timed, size = [], 0
    for fan_in, fan_out in layout:
        size += 4 * fan_in * fan_out
        if timed and size > MAX_DECODE_TIMED_BYTES:
            break
        timed.append((fan_in, fan_out))
    weights = [torch.randn(fan_out, fan_in, generator=generator) for fan_in, fan_out in timed]
    inputs = {fan_in: torch.randn(rows, fan_in, generator=generator) for fan_in, _ in timed}
    plain = [(inputs[w.shape[1]], w.t().contiguous()) for w in weights]
    packed = [(inputs[w.shape[1]], torch.ops.mkldnn._reorder_linear_weight(w)) for w in weights]
    del weights

    def aten() -> None:
        for x, w in plain:
            torch.mm(x, w)

    def onednn() -> None:
        for x, w in packed:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    best = {"aten": math.inf, "onednn": math.inf}
    sides = (("aten", aten), ("onednn", onednn))
    with torch.no_grad():
        for round_ in range(repeats + 1):  # the first round warms both up
            for library, step in sides if round_ % 2 else sides[::-1]:
                start = time.perf_counter()
                step()
                if round_:
                    best[library] = min(best[library], time.perf_counter() - start)
    return best["aten"] / max(best["onednn"], 1e-12)


def _kept(what: str, measure: Callable[[], float]) -> float:
    """`measure()`'s oneDNN speedup for `what` on this host, measured once and kept on disk
    (``$VERL_CACHE_DIR/cpu_matmul/``): the first process to finish measuring writes it, every other process
    (other ranks, later runs) reads that value, so a host makes one choice for a run's shapes."""
    key = f"{cpu_vendor()}|{cpu_model()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{what}"
    root = Path(os.environ.get("VERL_CACHE_DIR") or Path.home() / ".cache" / "verl") / "cpu_matmul"
    path = root / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return float(json.loads(path.read_text())["onednn_speedup"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    record = {"onednn_speedup": measure(), "cpu": cpu_model(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "what": what}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(record, f)
        try:
            os.link(f.name, path)  # fails if another process wrote it first: theirs is the host's value
        except FileExistsError:
            pass
        finally:
            os.unlink(f.name)
        return float(json.loads(path.read_text())["onednn_speedup"])
    except (OSError, ValueError, KeyError, TypeError):
        return record["onednn_speedup"]  # an unwritable cache: this process's own measurement


@cache
def host_speedup(products: tuple[Product, ...] = TIMED_PRODUCTS) -> float:
    """:func:`measured_speedup` of `products` on this host, measured once and kept on disk (:func:`_kept`)."""
    return _kept(f"{products}|min", lambda: measured_speedup(products=products))


@cache
def decode_speedup(rows: int, layout: DecodeLayout) -> float:
    """:func:`measured_decode_speedup` on this host, measured once and kept on disk (:func:`_kept`)."""
    return _kept(f"decode|{rows}|{layout}", lambda: measured_decode_speedup(rows, layout))


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinearFunction(torch.autograd.Function):
    """`F.linear` whose forward and both backward products run in oneDNN. The three products have the same
    multiply-adds (rows x in x out), so one size test in :func:`onednn_linear` decides for all of them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t())  # [..., out] x [out, in]
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = _onednn(rows.t(), x.reshape(-1, x.shape[-1]).t())  # [out, rows] x [rows, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, in oneDNN for float32 CPU products of at least :data:`MIN_MACS`."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or (bias is not None and bias.dtype != torch.float32)
            or math.prod(x.shape[:-1]) * weight.numel() < MIN_MACS):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return _onednn(x, weight, bias)


class OneDNNLinear(torch.nn.Linear):
    """An `nn.Linear` that multiplies with :func:`onednn_linear`; set by :func:`use_cpu_matmul`, not built."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def use_cpu_matmul(model: torch.nn.Module, library: Literal["aten", "onednn"]) -> torch.nn.Module:
    """Give `model`'s plain `nn.Linear` layers the multiplications of `library` (in place; returns `model`).

    Only the class changes, so parameters, hooks (FSDP, peft), the state dict and `isinstance` checks stay
    as they are; `aten` turns :class:`OneDNNLinear` layers back into plain ones.
    """
    source, target = (torch.nn.Linear, OneDNNLinear) if library == "onednn" else (OneDNNLinear, torch.nn.Linear)
    for module in model.modules():
        if type(module) is source:
            module.__class__ = target
    return model


__all__ = ["AUTO_MARGIN", "ENV_VAR", "LIBRARY_NAMES", "MIN_MACS", "DecodeLayout", "OneDNNLinear", "Product",
           "cpu_model", "cpu_vendor", "decode_speedup", "describe", "host_speedup", "measured_decode_speedup",
           "measured_speedup", "model_products", "onednn_available", "onednn_linear", "resolve", "resolve_decode",
           "use_cpu_matmul"]
