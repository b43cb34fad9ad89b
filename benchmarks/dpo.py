"""DPO training speed: verl's DPOTrainer against TRL's DPOTrainer on the same model, data and batch.

Run by hand (not a test):  python benchmarks/dpo.py [--device cuda] [--model tiny:qwen2:256:4]
Both trainers get the same locally built tiny model (no hub), the same preference pairs, batch size,
learning rate, beta and float32 weights; each run builds its trainer, takes --warmup steps, then --steps
timed steps. Rounds are interleaved (one run of each per round, alternating which goes first, so a load
burst on a shared machine hits both sides of a round alike) at 1 torch thread; printed: each side's median
steps/s and the median (min–max) over the rounds of the per-round ratio verl/TRL steps/s.
TRL is optional (`pip install verl[bench]`, or --trl-path to a side install); without it only verl's
numbers are printed. `--baseline cached` compares verl's pair rows (a pair's prompt and both answers in one row of
one forward, `verl.trainer.forward.pair_rows`) with verl's cached-prompt forward (the prompt once, then both
answers on its keys/values) instead of TRL.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import add_cpu_matmul_argument, cpu_model, load_average  # noqa: E402


def make_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Arithmetic questions with a correct (chosen) and a wrong (rejected) answer sentence."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        wrong = a + b + rng.choice([-11, -2, -1, 1, 2, 10])
        prompt = f"Solve the problem and write the result. What is {a} plus {b}?"
        rows.append({"prompt": prompt, "chosen": f" The answer is {a + b}.",
                     "rejected": f" Let's think step by step. The answer is {wrong}."})
    return rows


def model_dir(spec: str) -> str:
    """The folder for `spec`, building `tiny[:arch[:hidden[:layers]]]` exactly as verl's `model.path` does."""
    if spec != "tiny" and not spec.startswith("tiny:"):
        return spec
    from verl.models.tiny import build_tiny_model

    parts = spec.split(":")[1:]
    sizes = dict(zip(("hidden_size", "num_layers"), (int(p) for p in parts[1:3]), strict=False))
    return build_tiny_model(arch=parts[0] if parts else "qwen2", seed=0, **sizes)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_verl(args: argparse.Namespace, rows: list[dict[str, str]]) -> dict[str, float]:
    from verl.config.loader import build_config
    from verl.trainer.offline.dpo_trainer import DPOTrainer

    config = build_config({
        "model": {"path": args.model, "dtype": "float32"},
        "trainer": {"kind": "dpo", "device": args.device, "total_steps": args.warmup + args.steps,
                    "seed": args.seed, "cpu_matmul": args.cpu_matmul},
        "logging": {"backends": []},
        "dpo": {"beta": args.beta, "lr": args.lr, "precompute_ref": args.precompute_ref},
        "actor": {"micro_batch_size": 2 * args.batch_size},
        "data": {"train_batch_size": args.batch_size, "max_prompt_length": 64, "max_response_length": 64},
    })
    t0 = time.perf_counter()
    trainer = DPOTrainer(config, train_rows=rows)
    setup = time.perf_counter() - t0
    metrics = trainer.train_steps(args.warmup)
    sync(args.device)
    t0 = time.perf_counter()
    metrics += trainer.train_steps(args.steps)
    sync(args.device)
    seconds = time.perf_counter() - t0
    mean_loss = sum(m["loss"] for m in metrics) / len(metrics)
    return {"steps_per_s": args.steps / seconds, "setup_s": setup, "mean_loss": mean_loss}


def bench_cached(args: argparse.Namespace, rows: list[dict[str, str]]) -> dict[str, float]:
    """verl with its pair rows off (no mask is small enough): the cached-prompt forward."""
    from verl.trainer.forward import pair_rows

    limit, pair_rows.MAX_MASK_ENTRIES = pair_rows.MAX_MASK_ENTRIES, 0
    try:
        return bench_verl(args, rows)
    finally:
        pair_rows.MAX_MASK_ENTRIES = limit


def bench_trl(args: argparse.Namespace, rows: list[dict[str, str]]) -> dict[str, float] | None:
    try:
        import dataclasses

        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import DPOConfig, DPOTrainer
    except ImportError as e:
        print(f"TRL not available ({e}); install the bench extra (`pip install verl[bench]`) to compare")
        return None
    from verl.utils.hf_loader import load_hf_model

    model, tok = load_hf_model(model_dir(args.model), torch_dtype=torch.float32, device=args.device, for_training=True)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, *a: Any, **k: Any) -> None:
            sync(args.device)
            self.times.append(time.perf_counter())

    wanted = {"output_dir": tempfile.mkdtemp(prefix="trl-bench-"), "per_device_train_batch_size": args.batch_size,
              "max_steps": args.warmup + args.steps, "learning_rate": args.lr, "beta": args.beta,
              "loss_type": "sigmoid", "max_length": 128, "report_to": "none", "save_strategy": "no",
              "logging_steps": 10**6, "use_cpu": args.device == "cpu", "seed": args.seed, "bf16": False,
              "precompute_ref_log_probs": args.precompute_ref, "lr_scheduler_type": "constant",
              "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0, "dataloader_num_workers": 0}
    fields = {f.name for f in dataclasses.fields(DPOConfig)}
    cfg = DPOConfig(**{k: v for k, v in wanted.items() if k in fields})
    clock = Clock()
    t0 = time.perf_counter()
    trainer = DPOTrainer(model=model, ref_model=None, args=cfg, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, callbacks=[clock])
    setup = time.perf_counter() - t0
    out = trainer.train()
    timed = clock.times[args.warmup - 1 :]  # from the end of the last warm-up step
    seconds = timed[-1] - timed[0]
    return {"steps_per_s": (len(timed) - 1) / seconds, "setup_s": setup, "mean_loss": float(out.training_loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2:128:4", help="tiny[:arch[:hidden[:layers]]] or a local dir")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--precompute-ref", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    add_cpu_matmul_argument(parser)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (one run of each side per round)")
    parser.add_argument("--baseline", choices=["TRL", "cached"], default="TRL",
                        help="TRL's DPOTrainer, or verl's own cached-prompt forward (pair rows off)")
    parser.add_argument("--trl-path", default=os.environ.get("VERL_BENCH_TRL_PATH"),
                        help="folder to import TRL from (a side install); default: the environment")
    args = parser.parse_args()
    if args.trl_path:
        sys.path.insert(0, args.trl_path)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step includes one-off costs on both sides)")
    torch.set_num_threads(1)
    rows = make_pairs(args.pairs, args.seed)
    base = args.baseline
    sides = {"verl": bench_verl, base: bench_trl if base == "TRL" else bench_cached}
    runs: dict[str, list[dict[str, float]]] = {"verl": [], base: []}
    for r in range(args.rounds):
        for name in (("verl", base) if r % 2 == 0 else (base, "verl")):
            if name in sides:
                result = sides[name](args, rows)
                if result is None:  # TRL is not installed: say so once, run verl alone
                    del sides[name]
                else:
                    runs[name].append(result)
    print(f"\nDPO, {args.model}, batch {args.batch_size} pairs, {args.steps} timed steps per run on {args.device}, "
          f"1 thread, {args.rounds} interleaved rounds; {cpu_model()}; load average {load_average()}")
    print(f"{'trainer':<8} {'steps/s (median)':>17} {'setup s':>9} {'mean loss':>11}")
    for name, r in runs.items():
        if r:
            print(f"{name:<8} {statistics.median(x['steps_per_s'] for x in r):>17.2f} "
                  f"{statistics.median(x['setup_s'] for x in r):>9.1f} {r[-1]['mean_loss']:>11.4f}")
    if runs[base]:
        ratios = [v["steps_per_s"] / t["steps_per_s"] for v, t in zip(runs["verl"], runs[base], strict=True)]
        print(f"ratio verl/{base} steps/s: median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} rounds)")


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main))
