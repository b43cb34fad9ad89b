"""Where one verl GRPO step spends its time: each stage's `timing/*` over many steps, on the work of
benchmarks/grpo_vs_trl.py (same model, prompts, batch shape and settings; verl only, TRL not needed).

Run by hand (not a test):
    python benchmarks/grpo_stages.py [--sizes tiny,10m] [--steps 30]
Prints the minimum (the least disturbed step on a shared machine) and the median of each stage in ms;
`--count-ops K` also counts the work of K steps (aten ops, matmul FLOPs, model forwards), which, unlike
times, does not depend on the machine's load.
Point PYTHONPATH at another checkout to measure that code with the same script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ab import add_cpu_matmul_argument, load_average  # noqa: E402
from grpo_vs_trl import SIZES, VerlSide, make_prompts  # noqa: E402


def stages(args: argparse.Namespace, size: str) -> dict[str, tuple[float, float]]:
    from dpo import model_dir
    from transformers import AutoTokenizer

    model_path = model_dir(SIZES.get(size, size))
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_path), args.prompts, args.prompt_tokens)
    torch.manual_seed(args.seed)
    side = VerlSide(args, model_path, prompts)
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
    parser.add_argument("--count-ops", type=int, default=0, metavar="K",
                        help="also profile K more steps: aten ops, matmul FLOPs and model forwards per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for size in args.sizes.split(","):
        result = stages(args, size)
        print(f"\n{size}: {args.prompts} prompts x {args.n}, prompt {args.prompt_tokens} tokens, {args.new_tokens} "
              f"new tokens; {args.steps} steps; 1 thread; load average {load_average()}")
        print(f"{'stage':<22} {'min ms':>9} {'median ms':>10}")
        for key, (low, mid) in result.items():
            print(f"{key:<22} {low:>9.2f} {mid:>10.2f}")


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.stage_lines))
