"""Where one verl GRPO step spends its time: each stage's `timing/*` over many steps, on the work of
benchmarks/grpo_vs_trl.py (same model, prompts, batch shape and settings; verl only, TRL not needed).

Run by hand (not a test):
    python benchmarks/grpo_stages.py [--sizes tiny,10m] [--steps 30] [--kernels aten,onednn] [--peak] [--split 4]
Prints the minimum (the least disturbed step, or for the update one whose zero-advantage groups it skipped) and
the median of each stage in ms, per CPU matmul kernel (`trainer.cpu_matmul`, `--kernels`); `--count-ops K` also
counts the work of K steps (aten ops, matmul FLOPs and model forwards), which, unlike times, does not depend on the
machine's load.
`--peak` also counts each stage's matmul FLOPs (torch's FlopCounterMode, forward and backward, on 2 steps) and
measures this machine's float32 matmul peak on one thread (the best of repeated 512- and 1024-square products
on either library), and prints the share of that peak each stage reaches (its FLOPs over its median
time): the distance to the physical limit, stage by stage.
`--split K` times every aten op of K more steps (a dispatch mode around each call, not torch.profiler: under it, on
this VM, ops writing large fresh outputs ran several times slower in some steps, so elementwise ops looked like the
cost) and prints, per stage, the matmuls' ms per step and their own GFLOP/s (FLOPs from the shapes), the
attention's and every other op's ms, and their op count: whether a stage waits on its products or around them.
Point PYTHONPATH at another checkout to measure that code with the same script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ab import add_cpu_matmul_argument, load_average  # noqa: E402
from grpo_vs_trl import SIZES, VerlSide, make_prompts  # noqa: E402


def verl_side(args: argparse.Namespace, size: str) -> VerlSide:
    """grpo_vs_trl.py's verl side on model `size`, seeded, with its prompts."""
    from dpo import model_dir
    from transformers import AutoTokenizer

    model_path = model_dir(SIZES.get(size, size))
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_path), args.prompts, args.prompt_tokens)
    torch.manual_seed(args.seed)
    return VerlSide(args, model_path, prompts)


def stages(args: argparse.Namespace, size: str) -> dict[str, tuple[float, float]]:
    side = verl_side(args, size)
    side.steps(2, untimed=0)  # warm-up
    side.metrics.clear()
    side.steps(args.steps, untimed=0)
    keys = [k for k in side.metrics[0] if k.startswith("timing/")]
    out = {k: (1000 * min(m.get(k, 0.0) for m in side.metrics),
               1000 * statistics.median(m.get(k, 0.0) for m in side.metrics)) for k in keys}
    if args.count_ops:  # work, not time: the same on a loaded machine
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            side.steps(args.count_ops, untimed=0)
        events = [e for e in prof.events() if e.name.startswith("aten::")]
        top = sum(1 for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        flops = sum(e.flops or 0 for e in events)
        forwards = sum(1 for e in events if e.name == "aten::embedding")
        print(f"per step over {args.count_ops} steps: {top / args.count_ops:.0f} top-level aten ops, "
              f"{flops / args.count_ops / 1e9:.3f} GFLOP (matmuls), {forwards / args.count_ops:.1f} embedding lookups "
              "(model forwards, rollout steps included)")
    return out


# The stages `--peak` counts FLOPs for: timing key -> the RLTrainer method that runs it
STAGE_METHODS = {"generate": "generate", "old_logprobs": "compute_log_probs", "ref": "compute_ref_log_probs",
                 "reward": "compute_reward", "advantages": "compute_advantages", "update": "update_policy"}


def stage_flops(args: argparse.Namespace, size: str, steps: int = 2) -> dict[str, float]:
    """Matmul FLOPs per step of each stage (forward and backward), counted on ATen: oneDNN's products run
    the same multiplications outside the ops torch's counter sees."""
    from torch.utils.flop_counter import FlopCounterMode

    side = verl_side(argparse.Namespace(**{**vars(args), "cpu_matmul": "aten"}), size)
    side.steps(1, untimed=0)  # warm-up
    flops = dict.fromkeys(STAGE_METHODS, 0.0)
    for stage, name in STAGE_METHODS.items():
        real = getattr(side.trainer, name)

        def counted(*a, _real=real, _stage=stage, **k):
            with FlopCounterMode(display=False) as counter:
                out = _real(*a, **k)
            flops[_stage] += counter.get_total_flops() / steps
            return out

        setattr(side.trainer, name, counted)  # an instance attribute: the step looks it up at each call
    side.steps(steps, untimed=0)
    return flops


# Matrix products: aten op -> (argument holding the [.., K] input, the other operand, whether that one is [N, K])
_PRODUCTS = {"aten.mm.default": (0, 1, False), "aten.addmm.default": (1, 2, False), "aten.bmm.default": (0, 1, False),
             "aten.linear.default": (0, 1, True), "mkldnn._linear_pointwise.default": (0, 1, True),
             "mkldnn._linear_pointwise.binary": (0, 2, True)}


def _product_flops(name: str, args: tuple) -> float:
    x_at, w_at, weight_nk = _PRODUCTS[name]
    x, w = args[x_at], args[w_at]
    k, n = (w.shape[-1], w.shape[-2]) if weight_nk else (w.shape[-2], w.shape[-1])
    return 2.0 * (x.numel() // x.shape[-1]) * k * n


def op_split(args: argparse.Namespace, size: str, steps: int) -> dict[str, dict[str, float]]:
    """Per stage (generate, update), per step: ms in matmuls, their GFLOP, ms in attention and in other ops, and
    the op count, each aten call timed on its own (`--split`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpClock(TorchDispatchMode):
        def __init__(self, into: dict[str, float]) -> None:
            super().__init__()
            self.into = into

        def __torch_dispatch__(self, func, types, a=(), kw=None):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            out = func(*a, **(kw or {}))
            spent, name = time.perf_counter() - start, str(func)
            kind = "matmul" if name in _PRODUCTS else "attention" if "scaled_dot_product" in name else "other"
            self.into[kind] += spent * 1000 / steps
            self.into["ops"] += 1 / steps
            if kind == "matmul":
                self.into["gflop"] += _product_flops(name, a) / 1e9 / steps
            return out

    side = verl_side(args, size)
    side.steps(2, untimed=0)  # warm-up
    split: dict[str, dict[str, float]] = {}
    for stage in ("generate", "update"):
        into = split.setdefault(stage, dict.fromkeys(("matmul", "gflop", "attention", "other", "ops"), 0.0))
        method = STAGE_METHODS[stage]

        def clocked(*a, _real=getattr(side.trainer, method), _into=into, **k):  # noqa: ANN002, ANN003, ANN202
            with OpClock(_into):
                return _real(*a, **k)

        setattr(side.trainer, method, clocked)
    side.steps(steps, untimed=0)
    return split


def matmul_peak(repeats: int = 15) -> float:
    """This machine's float32 GFLOP/s on one thread: the best of `repeats` square products of 512 and 1024 on
    either library (the share of it a stage reaches then compares across kernels)."""
    from verl.utils.cpu_matmul import onednn_linear

    best = 0.0
    with torch.no_grad():
        for size in (512, 1024):
            a, w = torch.randn(size, size), torch.randn(size, size)
            for product in (torch.nn.functional.linear, onednn_linear):
                fastest = float("inf")
                for _ in range(repeats + 2):
                    start = time.perf_counter()
                    product(a, w)
                    fastest = min(fastest, time.perf_counter() - start)
                best = max(best, 2 * size**3 / fastest / 1e9)
    return best


def print_peak_shares(result: dict[str, tuple[float, float]], flops: dict[str, float], peak: float, size: str,
                      kernel: str) -> None:
    """Each stage's matmul GFLOP over its median time, as a share of this machine's measured peak (`--peak`)."""
    print(f"{'stage':<22} {'min ms':>9} {'median ms':>10} {'GFLOP':>8} {'GFLOP/s':>8} {'% of peak':>10}")
    flops["step"] = sum(flops[k] for k in STAGE_METHODS)
    shares = []
    for key, (low, mid) in result.items():
        stage = key.removeprefix("timing/")
        work = flops.get(stage, 0.0) / 1e9
        rate = work / (mid / 1000) if mid > 0 else 0.0
        print(f"{key:<22} {low:>9.2f} {mid:>10.2f} {work:>8.2f} {rate:>8.1f} {100 * rate / peak:>9.1f}%")
        if work > 0:
            shares.append(f"{stage} {mid:.0f} ms, {work:.2f} GFLOP, {100 * rate / peak:.0f}%")
    print(f"summary: {size} {kernel}, peak {peak:.0f} GFLOP/s (1 thread): " + "; ".join(shares))


def print_split(split: dict[str, dict[str, float]], result: dict[str, tuple[float, float]], size: str, kernel: str,
                steps: int) -> None:
    """`--split`: per stage, its median (ops untimed) and where its ops' time goes."""
    parts = [f"{stage} {result[f'timing/{stage}'][1]:.0f} ms: matmuls {v['matmul']:.0f} ms "
             f"({v['gflop'] / max(v['matmul'], 1e-9) * 1000:.0f} GFLOP/s), attention {v['attention']:.0f} ms, "
             f"other ops {v['other']:.0f} ms ({v['ops']:.0f} ops)" for stage, v in split.items()]
    print(f"summary: {size} {kernel}, per step over {steps} steps, each aten op timed: " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-share", action="store_true")
    add_cpu_matmul_argument(parser)
    parser.add_argument("--kernels", default=None,
                        help="comma-separated trainer.cpu_matmul values to measure in turn (default: --cpu-matmul)")
    parser.add_argument("--peak", action="store_true",
                        help="also each stage's matmul FLOPs and its share of this machine's measured peak")
    parser.add_argument("--split", type=int, default=0, metavar="K",
                        help="also time every aten op of K steps: matmuls (and their GFLOP/s), attention, the rest")
    parser.add_argument("--count-ops", type=int, default=0, metavar="K",
                        help="also profile K more steps: aten ops, matmul FLOPs and model forwards per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for size in args.sizes.split(","):
        flops = stage_flops(args, size) if args.peak else {}
        for kernel in (args.kernels or args.cpu_matmul).split(","):
            run = argparse.Namespace(**{**vars(args), "cpu_matmul": kernel})
            result = stages(run, size)
            peak = matmul_peak() if args.peak else None
            print(f"\n{size}: {args.prompts} prompts x {args.n}, prompt {args.prompt_tokens} tokens, "
                  f"{args.new_tokens} new tokens; {args.steps} steps; 1 thread; trainer.cpu_matmul={kernel}; "
                  f"load average {load_average()}")
            if peak is None:
                print(f"{'stage':<22} {'min ms':>9} {'median ms':>10}")
                for key, (low, mid) in result.items():
                    print(f"{key:<22} {low:>9.2f} {mid:>10.2f}")
            else:
                print_peak_shares(result, flops, peak, size, kernel)
            if args.split:
                print_split(op_split(run, size, args.split), result, size, kernel, args.split)


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.stage_lines))
