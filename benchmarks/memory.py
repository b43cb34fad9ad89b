"""Peak memory and seconds per GRPO step: full fine-tune (with and without a reference model) vs LoRA.

Run by hand (not a test):  python benchmarks/memory.py [--steps 2] [--layers 24] [--only lora16]

The model has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab
151,936, tied embeddings) with random weights, so no download is needed; the prompts are tokenised by the
local tiny tokenizer and sampling is restricted to its ids (every other logit gets -1e4 from a frozen bias
on the output head, the same in all three runs). It runs on CPU, float32, one torch thread.

Each configuration runs in a fresh child process, so its peak RSS (`ru_maxrss` from `os.wait4` on that
child) is its own: model build, the reference copy when there is one, gradients, AdamW state and the step's
activations. A step is a GRPO step of 2 prompts x 4 samples, 64 new tokens each, with the KL loss on (so
the reference runs) except in "full, no reference".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

RUNS = {
    "full_ref": ("full fine-tune + reference model", {"actor.kl_loss_coef": 0.001}),
    "full_noref": ("full fine-tune, no reference", {"actor.kl_loss_coef": 0.0}),
    "lora16": ("LoRA r=16, reference = adapters off", {"actor.kl_loss_coef": 0.001, "model.lora.rank": 16}),
}


def qwen25_05b_shaped(layers: int, tokenizer: Any) -> Any:
    """A Qwen2.5-0.5B-shaped causal LM with random weights whose sampling stays inside the tokenizer's ids."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=896, num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151_936, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=1_000_000.0, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    head = torch.nn.Linear(896, config.vocab_size, bias=True)
    head.weight = model.lm_head.weight  # still tied to the embeddings: no extra weights
    with torch.no_grad():
        head.bias.fill_(-1e4)
        head.bias[: len(tokenizer)] = 0.0
    head.bias.requires_grad_(False)
    model.lm_head = head
    return model


def child(name: str, steps: int, layers: int) -> None:
    """One configuration: build, train `steps` GRPO steps, print a JSON line of timings."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from verl.config.loader import apply_overrides, build_config
    from verl.models.tiny import build_tiny_model
    from verl.trainer.rl_trainer import RLTrainer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    start = time.perf_counter()
    model = qwen25_05b_shaped(layers, tokenizer)
    tree: dict[str, Any] = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"num_val": 1, "max_operand": 99}},
        "data": {"train_batch_size": 2},
        "rollout": {"n": 4, "max_new_tokens": 64, "temperature": 1.0},
        "actor": {"lr": 1e-5, "micro_batch_size": 8},
        "trainer": {"device": "cpu", "cpu_threads": 1, "total_steps": steps, "val_before_train": False,
                    "resume": "never"},
        "logging": {"backends": []},
    }
    apply_overrides(tree, [f"{k}={v}" for k, v in RUNS[name][1].items()])
    trainer = RLTrainer(build_config(tree), model=model, tokenizer=tokenizer)
    build_s = time.perf_counter() - start
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    seconds, stages = [], {}
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = trainer.step()
        trainer.step_count += 1
        seconds.append(time.perf_counter() - t0)
        for key in ("generate", "old_logprobs", "ref", "update"):
            stages[key] = stages.get(key, 0.0) + metrics.get(f"timing/{key}", 0.0) / steps
    print(json.dumps({"name": name, "seconds": seconds, "stages": stages, "build_s": build_s,
                      "trainable": trainable, "total": total,
                      "response_tokens": metrics.get("response/length_mean", 0.0)}), flush=True)


def measure(name: str, steps: int, layers: int) -> dict[str, Any]:
    """Run `name` in a fresh process; its result plus its own peak RSS (`os.wait4` rusage of that child)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--steps", str(steps), "--layers", str(layers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    kib = usage.ru_maxrss if sys.platform != "darwin" else usage.ru_maxrss / 1024
    result["peak_rss_gib"] = kib / 2**20
    return result


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per configuration (timed)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24 = Qwen2.5-0.5B)")
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="run only these configurations")
    parser.add_argument("--child", choices=sorted(RUNS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.layers)
        return
    results = {}
    for name in args.only or list(RUNS):
        results[name] = measure(name, args.steps, args.layers)
        r = results[name]
        print(f"# {name}: peak RSS {r['peak_rss_gib']:.2f} GiB, {sum(r['seconds']) / len(r['seconds']):.1f} s/step",
              file=sys.stderr, flush=True)
    print(f"CPU: {cpu_name()}, 1 torch thread, float32; {time.strftime('%Y-%m-%d')}; Qwen2.5-0.5B shape, "
          f"{args.layers} layers, random weights; GRPO step = 2 prompts x 4 samples x 64 new tokens; "
          f"{args.steps} step(s) each")
    print("| run | trainable / total params | peak RSS (GiB) | s/step | generate | old log-probs | ref | update |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["stages"]
        print(f"| {RUNS[name][0]} | {r['trainable'] / 1e6:.1f}M / {r['total'] / 1e6:.1f}M | {r['peak_rss_gib']:.2f} | "
              f"{sum(r['seconds']) / len(r['seconds']):.1f} | {s['generate']:.1f} | {s['old_logprobs']:.1f} | "
              f"{s['ref']:.1f} | {s['update']:.1f} |")
    if "lora16" in results and "full_ref" in results:
        ratio = results["lora16"]["peak_rss_gib"] / results["full_ref"]["peak_rss_gib"]
        print(f"LoRA r=16 peak RSS / full fine-tune with reference: {ratio:.2f} (target <= 0.55)")


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.table_and("LoRA r="), doc=doc_table.ROOT / "docs" / "lora.md"))
