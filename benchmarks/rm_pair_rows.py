"""Reward-model training steps with pair rows (a pair's shared tokens once, both answers in one row of one
forward: `verl.trainer.forward.pair_rows`) against scoring the chosen and rejected sequences whole.

Run by hand (not a test): ``python benchmarks/rm_pair_rows.py [--model tiny:qwen2:128:4] [--rounds 5]``.
Two `RMTrainer`s on the same model, pairs and batch, one with `actor.share_prompt_forward` (pair rows) and one
without; each round times --steps steps of each, interleaved, at 1 torch thread; printed: the median (min–max)
of the per-round ratio whole/pair-rows step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import add_cpu_matmul_argument, cpu_model, interleaved, ratio_line  # noqa: E402
from dpo import make_pairs  # noqa: E402


def build(args: argparse.Namespace, share: bool):
    from verl.config.loader import build_config
    from verl.trainer.offline.rm_trainer import RMTrainer

    config = build_config({
        "model": {"path": args.model, "dtype": "float32"},
        "trainer": {"kind": "rm", "device": "cpu", "total_steps": 10**6, "seed": args.seed,
                    "cpu_matmul": args.cpu_matmul},
        "logging": {"backends": []},
        "rm": {"lr": 1e-4},
        "actor": {"micro_batch_size": 2 * args.batch_size, "share_prompt_forward": share},
        "data": {"train_batch_size": args.batch_size, "max_prompt_length": 64, "max_response_length": 64},
    })
    return RMTrainer(config, train_rows=make_pairs(args.pairs, args.seed))


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2:128:4", help="tiny[:arch[:hidden[:layers]]] or a local dir")
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="training steps per side per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    add_cpu_matmul_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    whole, rows = build(args, share=False), build(args, share=True)
    result = interleaved(lambda: whole.train_steps(args.steps), lambda: rows.train_steps(args.steps), args.rounds)
    print(f"reward model, {args.model}, {args.batch_size} pairs a step, {args.steps} steps per side per round, "
          f"1 thread; {cpu_model()}")
    print(ratio_line("pair rows", result, "whole sequences"))
    return result["ratio"]


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc=doc_table.ROOT / "docs" / "optimizations.md"))
