"""Asynchronous RL against synchronous, on 2 processes of one thread each: response tokens trained per second.

Three runs of the same RL config (the tiny model, the same prompts and number of samples per step), each a
`verl train --nproc 2` in its own processes, in interleaved rounds:
- `sync-split`: rank 1 generates, then rank 0 trains, each waiting for the other (devices.rollout=[1],
  rollout.max_staleness=0: synchronous on the split ranks);
- `async`: the same two ranks with rollout.max_staleness=1 (rank 1 samples batch i+1 while rank 0 trains on i);
- `sync-dp`: both ranks generate and train their half of every batch (data parallel, colocated: what a user
  would otherwise run on two devices).
The workload has long-tailed response lengths, as real reasoning runs do, where the longest response sets a
synchronous step's pace: the tiny model is edited so that every token ends the response with probability
`--stop-prob` (a geometric length: with 0.04 and 128 new tokens the mean is ~25 and a batch's longest ~4x it;
the other tokens stay uniform, see `long_tailed_model`).
Throughput is the response tokens of the steps after the first `--warmup` over the wall time rank 0 spent
in them (`timing/step`, which for `async` includes its wait for the batch and the weight delivery). The
ratio lines give the median and min-max over the rounds of the per-round ratio.
Run by hand: ``python benchmarks/async_vs_sync.py [--rounds 3] [--steps 10] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_runs import ROOT, metric_rows, run_verl  # noqa: E402

REWARD = ROOT / "tests" / "trainer" / "rl_support.py"
VARIANTS = {
    "sync-split": {"devices": {"actor": [0], "rollout": [1]}, "rollout": {"max_staleness": 0}},
    "async": {"devices": {"actor": [0], "rollout": [1]}, "rollout": {"max_staleness": 1}},
    "sync-dp": {},
}


def long_tailed_model(folder: Path, stop_prob: float) -> Path:
    """The tiny model, edited so that each sampled token is its first eos id with probability `stop_prob`
    and any other token with equal probability: hidden dimension 0 is a constant that no layer writes, the
    final norm reads only it, and the (tied) embedding gives eos a logit `gap` above the rest there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.models.tiny import build_tiny_model

    source = build_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    gap = math.log(stop_prob * (vocab - len(eos)) / (1 - stop_prob))  # eos's logit above the others'
    with torch.no_grad():
        for head in {id(w): w for w in (model.get_input_embeddings().weight, model.lm_head.weight)}.values():
            head[:, 0] = 1.0
            head[eos[0], 0] = 1.0 + gap / math.sqrt(hidden)  # the final norm scales dimension 0 to sqrt(hidden)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def config(run_dir: Path, model: Path, steps: int, tokens: int, batch: int, variant: dict) -> dict:
    cfg = {
        "model": {"path": str(model), "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 99, "num_val": 8}},
        "data": {"train_batch_size": batch, "max_prompt_length": 16},
        "rollout": {"n": 4, "max_new_tokens": tokens, "temperature": 1.0},
        "reward": {"functions": [{"name": f"{REWARD}:digit_reward"}]},
        "actor": {"lr": 1e-6, "micro_batch_size": 64, "max_tokens_per_micro_batch": 2048},
        "trainer": {"total_steps": steps, "device": "cpu", "val_before_train": False, "cpu_threads": 1,
                    "run_dir": str(run_dir), "resume": "never"},
        "checkpoint": {"save_interval": 0},
        "logging": {"backends": ["jsonl"]},
    }
    for section, values in variant.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def run(name: str, root: Path, model: Path, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    """(response tokens per second of rank 0's steps after the warm-up, mean stage seconds)."""
    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config(run_dir, model, args.steps, args.tokens, args.batch, VARIANTS[name])))
    run_verl("train", str(path), "--nproc", "2", what=name)
    rows = metric_rows(run_dir)
    steps = [r for r in rows if "timing/step" in r and r["step"] > args.warmup]
    tokens = sum(r["response/length_mean"] * args.batch * 4 for r in steps)
    seconds = sum(r["timing/step"] for r in steps)
    stages = {k.split("/", 1)[1]: statistics.mean(r.get(k, 0.0) for r in steps)
              for k in sorted({k for r in steps for k in r if k.startswith("timing/") and k != "timing/step"})}
    return tokens / seconds, stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    parser.add_argument("--tokens", type=int, default=128, help="rollout.max_new_tokens")
    parser.add_argument("--stop-prob", type=float, default=0.04, help="each token ends the response with this")
    parser.add_argument("--batch", type=int, default=16, help="prompts per step (x 4 samples)")
    parser.add_argument("--run-root", type=Path, default=ROOT / "runs" / "async-vs-sync")
    args = parser.parse_args(argv)
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    model = long_tailed_model(args.run_root / "long-tailed-model", args.stop_prob)
    for r in range(args.rounds):
        for name in VARIANTS:
            rate, stages = run(name, args.run_root, model, args)
            rates[name].append(rate)
            print(f"round {r + 1} {name}: {rate:.0f} response tokens/s; mean s per step: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)
    for base in ("sync-split", "sync-dp"):
        ratios = [a / b for a, b in zip(rates["async"], rates[base], strict=True)]
        print(f"ratio async (max_staleness=1) vs {base}: median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x) over {len(ratios)} rounds; "
              f"{statistics.median(rates['async']):.0f} vs {statistics.median(rates[base]):.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import doc_table

    raise SystemExit(doc_table.run(main))
