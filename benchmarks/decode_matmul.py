"""The decode step's projections four ways, on one CPU thread: which matmul the rollout should use here.

Run by hand (not a test):
    python benchmarks/decode_matmul.py [--model tiny:qwen2:256:10] [--rows 16] [--rounds 7]
For every distinct projection shape of the model's decode layout (fused q/k/v, o, fused gate/up, down,
lm_head) with --rows rows (a rollout's batch x n), it times
  * ``F.linear(x, W)`` (MKL with the [out, in] weight as a transposed operand: the module's own call),
  * ``torch.mm(x, W_t)`` on a contiguous [in, out] copy (MKL, plain operands: what the decode step runs),
  * ``torch.mm(W, x^T)``: the module's own [out, in] weight as the left-hand operand, giving the transposed
    result [out, rows] (no copy of the weight to keep in step with it, but the rest of a decode step would
    then work on transposed activations),
  * oneDNN's prepacked linear (``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight``), an
    earlier decode layout, where this torch build has it,
  * ``verl.utils.cpu_matmul.onednn_linear`` on the plain [out, in] weight (oneDNN above its size threshold,
    ``F.linear`` below): what the decode step runs for ``trainer.cpu_matmul=onednn`` layers,
in interleaved rounds (benchmarks/ab.py) and prints each shape's median microseconds and the ratios of
the other three against ``torch.mm`` (median and min–max over the rounds), then the same summed over one
decode step. Each shape's weight stays in the cache there, call after call.
``--cold`` times whole decode steps instead: every projection of every layer with its own weight, in the
step's order, as a real step reads them (the weights stream from memory): ``mm``, ``F.linear`` and oneDNN's
prepacked linear, which is what ``trainer.cpu_matmul=auto`` measures for the decode
(``verl.utils.cpu_matmul.measured_decode_speedup``). Results depend on the CPU: the script prints its model name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ab import cpu_model, interleaved_times, load_average  # noqa: E402


def projection_shapes(model: torch.nn.Module) -> Counter[tuple[int, int]]:
    """(in, out) of each projection a decode step runs, with how many times per step."""
    shapes: Counter[tuple[int, int]] = Counter()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        shapes[(attn.q_proj.in_features, qkv)] += 1
        shapes[(attn.o_proj.in_features, attn.o_proj.out_features)] += 1
        shapes[(mlp.gate_proj.in_features, mlp.gate_proj.out_features + mlp.up_proj.out_features)] += 1
        shapes[(mlp.down_proj.in_features, mlp.down_proj.out_features)] += 1
    shapes[(model.lm_head.in_features, model.lm_head.out_features)] += 1
    return shapes


def cold_steps(args: argparse.Namespace, model: torch.nn.Module, has_onednn: bool) -> None:
    """Whole decode steps' projections, each with its own weight in the step's order, mm against the others."""
    layout = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layout += [(attn.q_proj.in_features, sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj))),
                   (attn.o_proj.in_features, attn.o_proj.out_features),
                   (mlp.gate_proj.in_features, mlp.gate_proj.out_features + mlp.up_proj.out_features),
                   (mlp.down_proj.in_features, mlp.down_proj.out_features)]
    layout.append((model.lm_head.in_features, model.lm_head.out_features))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(fan_out, fan_in, generator=generator) for fan_in, fan_out in layout]
    inputs = {fan_in: torch.randn(args.rows, fan_in, generator=generator) for fan_in, _ in layout}
    plain = [(inputs[w.shape[1]], w.t().contiguous()) for w in weights]
    sides = {"mm": lambda: [torch.mm(x, w) for x, w in plain],
             "F.linear": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights]}
    if has_onednn:
        packed = [(inputs[w.shape[1]], torch.ops.mkldnn._reorder_linear_weight(w)) for w in weights]
        sides["oneDNN"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in packed]
    size = sum(4 * w.numel() for w in weights) / 2**20
    with torch.inference_mode():
        times = interleaved_times({k: (lambda f=f: [f() for _ in range(args.calls // 10 or 1)])
                                   for k, f in sides.items()}, args.rounds)
    mm_ms = 1e3 * statistics.median(times["mm"]) / (args.calls // 10 or 1)
    cells = []
    for name in sides:
        if name != "mm":
            ratios = [a / b for a, b in zip(times[name], times["mm"], strict=True)]
            cells.append(f"{name} {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"cold decode step ({len(layout)} projections, {size:.0f} MiB of weights, each read once a step): mm "
          f"{mm_ms:.2f} ms; time against mm: " + ", ".join(cells)
          + f"; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def onednn_available() -> bool:
    try:
        weight = torch.randn(8, 8)
        torch.ops.mkldnn._linear_pointwise(torch.randn(2, 8), torch.ops.mkldnn._reorder_linear_weight(weight),
                                           None, "none", [], "")
        return True
    except (AttributeError, RuntimeError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2:256:10", help="a model spec as benchmarks/dpo.py takes")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="calls per side per round (--cold: steps x 10)")
    parser.add_argument("--cold", action="store_true", help="whole decode steps, each weight read once a step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from dpo import model_dir
    from transformers import AutoModelForCausalLM

    from verl.utils.cpu_matmul import onednn_linear

    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), dtype=torch.float32)
    shapes = projection_shapes(model)
    has_onednn = onednn_available()
    print(f"{args.model}: {args.rows} rows, 1 thread, {args.rounds} interleaved rounds of "
          f"{f'{args.calls // 10 or 1} steps' if args.cold else f'{args.calls} calls'}; "
          f"{cpu_model()}; torch {torch.__version__}; load average {load_average()}")
    if args.cold:
        return cold_steps(args, model, has_onednn)
    others = ("F.linear", "W@x^T", "oneDNN", "onednn_linear")
    print(f"{'in x out':>12} {'per step':>8} {'mm us':>8} " + " ".join(f"{name + '/mm':>18}" for name in others))
    per_step: dict[str, list[float]] = {}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (fan_in, fan_out), count in sorted(shapes.items()):
            weight = torch.randn(fan_out, fan_in, generator=generator)
            x = torch.randn(args.rows, fan_in, generator=generator)
            weight_t = weight.t().contiguous()
            sides = {"mm": lambda x=x, w=weight_t: torch.mm(x, w),
                     "F.linear": lambda x=x, w=weight: F.linear(x, w),
                     "W@x^T": lambda x=x, w=weight: torch.mm(w, x.t())}
            if has_onednn:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight)
                sides["oneDNN"] = lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                sides["onednn_linear"] = lambda x=x, w=weight: onednn_linear(x, w)

            def repeat(fn, calls=args.calls):
                return lambda: [fn() for _ in range(calls)]

            times = interleaved_times({k: repeat(f) for k, f in sides.items()}, args.rounds)
            for name, ts in times.items():
                rounds = per_step.setdefault(name, [0.0] * args.rounds)
                for r, t in enumerate(ts):
                    rounds[r] += count * t / args.calls
            cells = []
            for name in others:
                if name not in times:
                    cells.append(f"{'n/a':>18}")
                    continue
                ratios = [a / b for a, b in zip(times[name], times["mm"], strict=True)]
                cells.append(f"{statistics.median(ratios):>6.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
            mm_us = 1e6 * statistics.median(times["mm"]) / args.calls
            print(f"{fan_in:>5} x {fan_out:<5} {count:>8} {mm_us:>8.1f} " + " ".join(f"{c:>18}" for c in cells))
    summary = []
    for name in others:
        if name in per_step:
            ratios = [a / b for a, b in zip(per_step[name], per_step["mm"], strict=True)]
            summary.append(f"{name} {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    mm_step = 1e3 * statistics.median(per_step["mm"])
    print(f"one decode step's projections: mm {mm_step:.2f} ms; time against mm: " + ", ".join(summary)
          + f"; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.prefixed("one decode step", "cold decode step")))
