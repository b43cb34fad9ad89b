"""Update throughput: token-budget micro-batches and packed sequences against fixed-size micro-batches on
the same batch.

Run by hand (not a test):
    python benchmarks/micro_batches.py [--model tiny:qwen2:256:10] [--rounds 5]
One PPO/GRPO update (forward, backward, AdamW step) of the same batch of --sequences sequences whose
response lengths are spread uniformly over --min-len..--max-len tokens. Baseline: `actor.micro_batch_size`
= --micro sequences at a time (each micro-batch padded to the batch's longest response). Candidates:
`actor.max_tokens_per_micro_batch` = micro x (prompt + max response) tokens, i.e. the same peak
activation size, with sequences grouped by length and trimmed; and the same budget with
`actor.remove_padding` (each micro-batch's sequences packed into one row: no padding at all, the budget
counting real tokens). All compute the same gradient (tests/trainer/test_rl_update_efficiency.py,
tests/trainer/test_remove_padding.py). 1 torch thread; interleaved rounds (benchmarks/ab.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import interleaved_times, load_average, ratios  # noqa: E402

from verl.trainer.rl.update import micro_batch_groups  # noqa: E402


def make_batch(args: argparse.Namespace, vocab: int):
    from verl.batch import RolloutBatch

    g = torch.Generator().manual_seed(args.seed)
    n, p, r = args.sequences, args.prompt_len, args.max_len
    lengths = torch.randint(args.min_len, args.max_len + 1, (n,), generator=g)
    response_mask = (torch.arange(r)[None, :] < lengths[:, None]).long()
    return RolloutBatch(
        rows=[{} for _ in range(n)], group_ids=torch.arange(n) // 4,
        prompt_ids=torch.randint(3, vocab, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (n, r), generator=g) * response_mask, response_mask=response_mask,
        advantages=torch.randn(n, generator=g)[:, None] * response_mask)


def trainer_for(args: argparse.Namespace, budget: int | None, packed: bool = False):
    from verl.config.loader import build_config
    from verl.trainer.rl_trainer import RLTrainer

    # Every row has its own random prompt here, so there is nothing for the shared-prompt forward to share;
    # off on both sides, rows are packed by length alone (with it on, a GRPO group's rows stay together).
    actor = {"micro_batch_size": args.micro, "lr": 1e-5, "max_tokens_per_micro_batch": budget,
             "share_prompt_forward": False, "remove_padding": packed}
    config = build_config({
        "model": {"path": args.model, "dtype": "float32"}, "trainer": {"device": "cpu", "cpu_threads": 1},
        "env": {"name": "arithmetic"}, "logging": {"backends": []}, "data": {"train_batch_size": args.sequences // 4},
        "rollout": {"n": 4, "max_new_tokens": args.max_len}, "actor": actor,
    })
    return RLTrainer(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2:256:10", help="tiny[:arch[:hidden[:layers]]] or a local dir")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.model.startswith("tiny"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from dpo import model_dir

        args.model = model_dir(args.model)
    budget = args.micro * (args.prompt_len + args.max_len)
    sides = {"fixed micro-batches": trainer_for(args, None), "token budget": trainer_for(args, budget),
             "packed": trainer_for(args, budget, packed=True)}
    for trainer in sides.values():
        trainer.model.load_state_dict(sides["fixed micro-batches"].model.state_dict())
    tokenizer = sides["token budget"].tokenizer
    batch = make_batch(args, tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 700)
    groups = micro_batch_groups(batch, args.micro, budget)
    padded = sum(len(g) * (args.prompt_len + int(batch.response_mask[g].sum(-1).max())) for g in groups)
    packed_groups = micro_batch_groups(batch, args.micro, budget, packed=True)
    real = int(batch.attention_mask.sum())
    print(f"update of {args.sequences} sequences, prompt {args.prompt_len}, responses "
          f"{args.min_len}-{args.max_len} tokens; model {args.model}")
    print(f"fixed micro-batches of {args.micro}: {-(-args.sequences // args.micro)} micro-batches, "
          f"{args.sequences * (args.prompt_len + args.max_len)} padded tokens")
    print(f"token budget {budget}: {len(groups)} micro-batches, {padded} padded tokens ({real} real); packed: "
          f"{len(packed_groups)} micro-batches of {real} real tokens")
    times = interleaved_times({name: (lambda t=t: t.update_policy(batch)) for name, t in sides.items()}, args.rounds)
    for name, base in (("token budget", "fixed micro-batches"), ("packed", "fixed micro-batches"),
                       ("packed", "token budget")):
        r = ratios(times[base], times[name])
        print(f"ratio {name} vs {base}: median {r['ratio']:.2f}x (min {r['ratio_min']:.2f}x, max "
              f"{r['ratio_max']:.2f}x over {args.rounds} rounds; {r['baseline_s']:.3f}s vs {r['candidate_s']:.3f}s "
              f"per update median)")
    print(f"load average {load_average()}")

if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main))
