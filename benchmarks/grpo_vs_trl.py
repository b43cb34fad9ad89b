"""GRPO training speed: verl's RLTrainer against TRL's GRPOTrainer on the same work.

Run by hand (not a test):
    python benchmarks/grpo_vs_trl.py [--trl-path /tmp/trl-side] [--sizes tiny,10m] [--rounds 5]
TRL is optional; it is imported from --trl-path (or $VERL_BENCH_TRL_PATH) when given, else from the
environment. Install it apart from the project's venv, e.g.
    pip install --no-deps --target /tmp/trl-side trl datasets dill multiprocess xxhash pandas

Both trainers get the same Hugging Face model folder (float32), the same plain-text prompts (no chat
template), the same reward function and batch shape: --prompts prompts x --n samples, exactly
--new-tokens new tokens per completion (eos cannot stop a completion on either side), temperature 1,
no reference model (TRL beta=0, verl without KL), no gradient checkpointing, one fused-AdamW step per
batch, grad clip 1.0. The script asserts the work matches (completions per step, tokens generated, optimizer
steps, no reference). Rounds are interleaved at 1 torch thread (benchmarks/ab.py): each round times
--steps steps of each side after one warm-up step; the ratio is TRL seconds per step / verl seconds per step.
`--prompt-tokens` sets the prompt length (e.g. 128 with --new-tokens 32: GSM8K-like proportions).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ab import add_cpu_matmul_argument, load_average  # noqa: E402

SIZES = {"tiny": "tiny", "10m": "tiny:qwen2:256:10"}
WORDS = ("the apples cost three dollars each and a basket holds twelve of them while the farmer sells "
         "half of what is left every morning to the market before noon").split()


def digit_reward_text(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def verl_reward(prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
    return digit_reward_text(response)


def trl_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [digit_reward_text(c) for c in completions]


def make_prompts(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """`count` distinct word-problem prompts of exactly `tokens` tokens under `tokenizer`."""
    prompts = []
    for i in range(count):
        words, text = [], ""
        j = i
        while True:
            words.append(WORDS[j % len(WORDS)])
            j += i + 1
            candidate = f"Q{i}: " + " ".join(words) + ". How many?"
            if len(tokenizer(candidate, add_special_tokens=False)["input_ids"]) > tokens:
                break
            text = candidate
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) < tokens:  # top up one character at a time
            text += "!"
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(text)
    return prompts


class VerlSide:
    def __init__(self, args: argparse.Namespace, model_path: str, prompts: list[str]) -> None:
        from verl.config.loader import build_config
        from verl.trainer.rl_trainer import RLTrainer

        config = build_config({
            "model": {"path": model_path, "dtype": "float32"},
            "data": {"train_batch_size": args.prompts, "apply_chat_template": "never",
                     "max_prompt_length": args.prompt_tokens + 8},
            "rollout": {"n": args.n, "max_new_tokens": args.new_tokens, "temperature": 1.0},
            "actor": {"lr": args.lr, "micro_batch_size": args.prompts * args.n, "grad_clip": 1.0,
                      "share_prompt_forward": not args.no_share},
            "trainer": {"device": "cpu", "cpu_threads": 1, "seed": args.seed, "total_steps": 10**6,
                        "cpu_matmul": args.cpu_matmul,
                        "run_dir": tempfile.mkdtemp(prefix="verl-bench-"), "val_before_train": False,
                        "resume": "never"},
            "logging": {"backends": []},
        })
        rows = [{"prompt": p, "ground_truth": "0"} for p in prompts]
        self.trainer = RLTrainer(config, rows=rows, reward_functions=[verl_reward])
        # exactly --new-tokens per completion, as on the TRL side
        self.trainer.sampling = dataclasses.replace(self.trainer.sampling, eos_token_ids=[])
        assert self.trainer.ref_model is None and not config.needs_ref
        self.metrics: list[dict[str, float]] = []

    def optimizer_steps(self) -> int:
        states = [s for s in self.trainer.optimizer.state.values() if "step" in s]
        return int(states[0]["step"]) if states else 0

    def steps(self, k: int, untimed: int = 1) -> list[float]:
        """k timed steps after `untimed` ones, like TRLSide (whose train() call times from its first step's end):
        each side's first step of a round runs on caches the other side just used."""
        times = []
        for i in range(untimed + k):
            before = self.optimizer_steps()
            start = time.perf_counter()
            metrics = self.trainer.step()
            if i >= untimed:
                times.append(time.perf_counter() - start)
            self.trainer.step_count += 1
            assert self.optimizer_steps() == before + 1, "verl: one optimizer step per batch"
            self.metrics.append(metrics)
        return times


class TRLSide:
    def __init__(self, args: argparse.Namespace, model_path: str, prompts: list[str]) -> None:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        outer = self

        class Clock(TrainerCallback):
            def on_step_end(self, *a: Any, **k: Any) -> None:
                outer.stamps.append(time.perf_counter())

            def on_log(self, *a: Any, logs: dict | None = None, **k: Any) -> None:
                for key in ("completions/min_length", "completions/max_length"):
                    if logs and key in logs:
                        outer.lengths.append(float(logs[key]))

        wanted = {"output_dir": tempfile.mkdtemp(prefix="trl-bench-"),
                  "per_device_train_batch_size": args.prompts * args.n,
                  "num_generations": args.n, "max_completion_length": args.new_tokens, "beta": 0.0,
                  "learning_rate": args.lr, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "num_iterations": 1,
                  "gradient_accumulation_steps": 1, "gradient_checkpointing": False, "bf16": False, "fp16": False,
                  "use_cpu": True, "report_to": "none", "save_strategy": "no", "logging_steps": 10**6,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
                  "optim": "adamw_torch_fused", "disable_dropout": True, "seed": args.seed, "max_steps": 1,
                  "dataloader_num_workers": 0, "log_completions": False, "disable_tqdm": True,
                  "generation_kwargs": {"min_new_tokens": args.new_tokens}}  # eos never stops a completion
        fields = {f.name for f in dataclasses.fields(GRPOConfig)}
        missing = sorted(set(wanted) - fields)
        if missing:
            print(f"note: this TRL's GRPOConfig has no {missing}")
        cfg = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})
        data = Dataset.from_list([{"prompt": p} for p in prompts] * 1000)
        self.trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=cfg, train_dataset=data,
                                   processing_class=tokenizer, callbacks=[Clock()])
        assert getattr(self.trainer, "ref_model", None) is None, "TRL: no reference model (beta=0)"
        self.stamps: list[float] = []
        self.global_steps = 0
        self.lengths: list[float] = []

    def steps(self, k: int) -> list[float]:
        """k timed steps: one train() call of k + 1 steps, timed between consecutive step ends."""
        self.stamps = []
        self.trainer.args.max_steps = k + 1
        self.trainer.train()
        assert self.trainer.state.global_step == k + 1, "TRL: one optimizer step per batch"
        self.global_steps += k + 1
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def run_size(args: argparse.Namespace, size: str) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from dpo import model_dir
    from transformers import AutoTokenizer

    model_path = model_dir(SIZES.get(size, size))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_tokens)
    torch.manual_seed(args.seed)
    verl = VerlSide(args, model_path, prompts)
    trl = TRLSide(args, model_path, prompts) if args.trl else None
    verl.steps(1, untimed=0)  # warm-up of the whole run
    verl_s, trl_s, ratios = [], [], []
    for r in range(args.rounds):
        first, second = (verl, trl) if r % 2 == 0 else (trl, verl)
        times = {}
        for side in (first, second):
            if side is not None:
                times[side] = statistics.median(side.steps(args.steps))
        verl_s.append(times[verl])
        if trl is not None:
            trl_s.append(times[trl])
            ratios.append(times[trl] / times[verl])
    # the work matched
    n_seq = args.prompts * args.n
    for m in verl.metrics:
        assert m["response/length_mean"] == args.new_tokens and m["response/length_max"] == args.new_tokens
        assert abs(m["prompt/length_mean"] - args.prompt_tokens) < 1e-9, m["prompt/length_mean"]
    assert verl.trainer.config.data.train_batch_size * verl.trainer.config.rollout.n == n_seq
    if trl is not None:
        assert trl.trainer.args.per_device_train_batch_size == n_seq and trl.trainer.num_generations == args.n
        assert trl.lengths and all(abs(x - args.new_tokens) < 1e-6 for x in trl.lengths), trl.lengths
    return {"size": size, "model": model_path, "verl_s": statistics.median(verl_s),
            "trl_s": statistics.median(trl_s) if trl_s else None, "ratios": ratios,
            "params": sum(p.numel() for p in verl.trainer.model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-path", default=os.environ.get("VERL_BENCH_TRL_PATH"),
                        help="folder to import TRL (and its extra deps) from; default: the environment")
    parser.add_argument("--sizes", default="tiny,10m", help="tiny, 10m or a model folder, comma-separated")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-share", action="store_true", help="verl without the shared-prompt forward")
    add_cpu_matmul_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.trl_path:
        sys.path.insert(0, args.trl_path)
    try:
        import trl  # noqa: F401

        args.trl = True
    except ImportError as e:
        print(f"TRL not importable ({e}); pass --trl-path to compare. Only verl's times are printed.")
        args.trl = False
    results = [run_size(args, size) for size in args.sizes.split(",")]
    print(f"\nGRPO, {args.prompts} prompts x {args.n} samples, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, 1 AdamW step per batch, no reference; 1 thread; "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'size':<6} {'params':>10} {'verl s/step':>12} {'TRL s/step':>11}  ratio TRL/verl median (min-max)")
    for r in results:
        if r["ratios"]:
            spread = f"{statistics.median(r['ratios']):.2f}x ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})"
            print(f"{r['size']:<6} {r['params']:>10} {r['verl_s']:>12.3f} {r['trl_s']:>11.3f}  {spread}")
        else:
            print(f"{r['size']:<6} {r['params']:>10} {r['verl_s']:>12.3f} {'-':>11}")
    for r in results:
        if r["ratios"]:
            print(f"ratio verl vs TRL GRPOTrainer ({r['size']}): {statistics.median(r['ratios']):.2f}x "
                  f"(min {min(r['ratios']):.2f}x, max {max(r['ratios']):.2f}x); load average {load_average()}")


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main))
