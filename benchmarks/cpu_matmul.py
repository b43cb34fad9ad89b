"""A model's linear layers on one CPU thread, ATen (`F.linear`, MKL) against oneDNN (`trainer.cpu_matmul`).

Run by hand (not a test):
    python benchmarks/cpu_matmul.py [--model tiny:qwen2:256:10] [--rows 512,16] [--rounds 7]
For every distinct (in, out) shape of the model's `nn.Linear` layers and each --rows count (512: an update's
micro-batch of tokens; 16: a decode step of 4 prompts x 4 samples), it times the forward and backward
(input and weight gradients) of `F.linear` and of `verl.utils.cpu_matmul.onednn_linear` in interleaved
rounds (benchmarks/ab.py), and prints each shape's times, GFLOP/s (forward + both backward products) and
ratio ATen time / oneDNN time (> 1: oneDNN is faster),
then the sum over one forward+backward of all the model's layers. The result depends on the processor
(the script prints its name and what `trainer.cpu_matmul=auto` picks there).
`--whole-model MIN:MAX:STEPS` also times the whole model's forward and backward (16 rows of random tokens),
a copy of it on each library, for STEPS steps whose width is drawn between MIN and MAX tokens, as response
lengths vary in RL: each new width makes oneDNN build new primitives, which the fixed shapes above never do.
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


def linear_shapes(model: torch.nn.Module) -> Counter[tuple[int, int]]:
    """(in, out) of every linear layer, with how many layers have it."""
    return Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2:256:10", help="a model spec as benchmarks/dpo.py takes")
    parser.add_argument("--rows", default="512,16", help="rows per product (tokens), comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="forward+backward calls per side per round")
    parser.add_argument("--whole-model", metavar="MIN:MAX:STEPS", default=None,
                        help="also time the whole model over STEPS steps of widths drawn in MIN..MAX")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from dpo import model_dir
    from transformers import AutoModelForCausalLM

    from verl.utils.cpu_matmul import onednn_available, onednn_linear, resolve

    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN linear: nothing to compare")
    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), dtype=torch.float32)
    shapes = linear_shapes(model)
    library, why = resolve("auto")
    print(f"{args.model}: {args.rounds} interleaved rounds of {args.calls} forward+backward calls, 1 thread; "
          f"{cpu_model()}; torch {torch.__version__}; trainer.cpu_matmul=auto picks {library} ({why}); "
          f"load average {load_average()}")
    generator = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        print(f"\n{rows} rows{'':<8}{'in x out':>12} {'layers':>7} {'ATen us':>9} {'oneDNN us':>10} "
              f"{'ATen GF/s':>10} {'oneDNN GF/s':>12}  ATen/oneDNN")
        totals: dict[str, list[float]] = {"aten": [0.0] * args.rounds, "onednn": [0.0] * args.rounds}
        for (fan_in, fan_out), count in sorted(shapes.items()):
            x = torch.randn(rows, fan_in, generator=generator).requires_grad_()
            weight = (torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5).requires_grad_()
            grad = torch.randn(rows, fan_out, generator=generator)

            def side(fn, calls=args.calls, x=x, weight=weight, grad=grad):
                def run() -> None:
                    for _ in range(calls):
                        x.grad = weight.grad = None
                        fn(x, weight).backward(grad)
                return run

            times = interleaved_times({"aten": side(F.linear), "onednn": side(onednn_linear)}, args.rounds)
            for name, ts in times.items():
                for r, t in enumerate(ts):
                    totals[name][r] += count * t / args.calls
            per_round = [a / b for a, b in zip(times["aten"], times["onednn"], strict=True)]
            us = {k: 1e6 * statistics.median(v) / args.calls for k, v in times.items()}
            gflops = {k: 3 * 2 * rows * fan_in * fan_out / (1e3 * t) for k, t in us.items()}  # 3 products
            print(f"{'':<17}{fan_in:>5} x {fan_out:<5} {count:>7} {us['aten']:>9.1f} {us['onednn']:>10.1f} "
                  f"{gflops['aten']:>10.1f} {gflops['onednn']:>12.1f}  "
                  f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f})")
        per_round = [a / b for a, b in zip(totals["aten"], totals["onednn"], strict=True)]
        print(f"ratio oneDNN vs ATen, all layers forward+backward at {rows} rows: {statistics.median(per_round):.2f}x "
              f"(min {min(per_round):.2f}x, max {max(per_round):.2f}x); "
              f"ATen {1e3 * statistics.median(totals['aten']):.2f} ms, "
              f"oneDNN {1e3 * statistics.median(totals['onednn']):.2f} ms; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.whole_model:
        whole_model(model, args.whole_model)


def whole_model(model: torch.nn.Module, spec: str) -> None:
    """Forward+backward of the model on each library over steps of random widths, interleaved per step."""
    import copy
    import random

    from verl.utils.cpu_matmul import use_cpu_matmul

    low, high, steps = (int(v) for v in spec.split(":"))
    models = {"aten": model, "onednn": use_cpu_matmul(copy.deepcopy(model), "onednn")}
    rng = random.Random(0)
    vocab = model.get_input_embeddings().num_embeddings
    seconds = {name: [] for name in models}
    for step in range(steps + 1):  # the first step warms both up
        ids = torch.randint(0, vocab, (16, rng.randint(low, high)))
        for name in list(models) if step % 2 == 0 else list(models)[::-1]:
            start = time.perf_counter()
            models[name](input_ids=ids).logits.mean().backward()
            if step:
                seconds[name].append(time.perf_counter() - start)
            models[name].zero_grad(set_to_none=True)
    per_step = [a / b for a, b in zip(seconds["aten"], seconds["onednn"], strict=True)]
    print(f"\nratio oneDNN vs ATen, whole model forward+backward, 16 rows x {low}-{high} tokens, {steps} steps: "
          f"{sum(seconds['aten']) / sum(seconds['onednn']):.2f}x in total (per step median "
          f"{statistics.median(per_step):.2f}x, min {min(per_step):.2f}x, max {max(per_step):.2f}x); "
          f"ATen {sum(seconds['aten']):.2f} s, oneDNN {sum(seconds['onednn']):.2f} s; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main))
