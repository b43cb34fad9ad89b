"""Peak activation memory per rank of one forward+backward on a long sequence: one rank against 2 (or S)
sequence-parallel ranks (`actor.sequence_parallel_size`, Ulysses: verl.distributed.sequence_parallel).

Run by hand (not a test):
``python benchmarks/sequence_parallel.py [--tokens 4096 --size 2 --layers 4 --hidden 256 --vocab 32000] [--chunked]
[--write-docs]``

Each configuration runs in fresh child processes (one per rank; the ranks join a gloo group), CPU, float32,
one torch thread. A child builds a Qwen2-shaped model with random weights, runs one short forward+backward
(so the gradient buffers and the allocator exist), takes its resident memory as the baseline, then runs the
measured forward+backward of the actor's loss terms (response log-probs and entropy, as the update computes
them) on one sequence of `--tokens` tokens (a `--prompt`-token prompt and the rest response). Its peak is
`ru_maxrss` minus that baseline: the activations (and logits) of the step, not the weights or gradients. The
child checks that the step raised its high-water mark, else the figure would be the build's.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_table  # noqa: E402
from rank_children import rss_kib, run_ranks  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One rank: build, warm up, measure; print one JSON line."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.batch import RolloutBatch
    from verl.distributed.sequence_parallel import SequenceParallel, enable_sequence_parallel
    from verl.trainer.forward.logprobs import logprobs_of

    torch.set_num_threads(1)
    size = args.size if args.rank is not None else 1
    sp = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=size)
        sp = SequenceParallel(dist.group.WORLD, tuple(range(size)), args.rank)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.tokens + 64, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    if sp is not None:
        enable_sequence_parallel(model, size)

    def batch(tokens: int, prompt: int) -> RolloutBatch:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, args.vocab, (1, tokens), generator=g)
        ones = torch.ones(1, tokens, dtype=torch.long)
        return RolloutBatch(rows=[{}], group_ids=torch.zeros(1, dtype=torch.long), prompt_ids=ids[:, :prompt],
                            prompt_mask=ones[:, :prompt], response_ids=ids[:, prompt:], response_mask=ones[:, prompt:])

    def step(mb: RolloutBatch) -> None:
        logprobs, entropy = logprobs_of(model, mb, share=False, temperature=1.0, with_entropy=True, sp=sp,
                                        chunked=args.chunked)
        (-(logprobs.mean()) - 0.01 * entropy.mean()).backward()

    step(batch(64, 16))  # gradient buffers and allocator pools exist before the baseline
    model.zero_grad(set_to_none=False)
    baseline, high_before = rss_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(batch(args.tokens, args.prompt))
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rank": args.rank or 0, "peak_mib": (high - baseline) / 1024, "raised": high > high_before,
                      "baseline_mib": baseline / 1024}), flush=True)
    if sp is not None:
        dist.destroy_process_group()


def _shape_args(args: argparse.Namespace) -> list[str]:
    return ["--tokens", str(args.tokens), "--prompt", str(args.prompt), "--layers", str(args.layers), "--hidden",
            str(args.hidden), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab),
            *(["--chunked"] if args.chunked else [])]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="sequence length (prompt + response)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--size", type=int, default=2, help="sequence-parallel ranks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunked", action="store_true", help="log-probs and entropy from the head's input in "
                        "chunks (actor.chunked_logprobs), on both sides")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse()
    if args.child:
        child(args)
        return 0
    one = run_ranks(__file__, _shape_args(args), 1)[0]
    split = run_ranks(__file__, _shape_args(args), args.size)
    if not one["raised"] or not all(r["raised"] for r in split):
        raise SystemExit("a step did not raise its process's high-water mark: the model build dominates; use a "
                         "longer --tokens or a smaller model")
    print(f"one forward+backward of the actor's log-probs and entropy on 1 sequence of {args.tokens} tokens "
          f"({args.prompt} prompt), Qwen2-shaped: {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads} KV), vocab {args.vocab}; log-probs {'chunked' if args.chunked else 'from the logits'}; "
          "CPU float32, 1 thread per rank")
    print("| run | peak activation MiB | share of one rank |")
    print("|---|---|---|")
    print(f"| one rank | {one['peak_mib']:.0f} | 100% |")
    for r in split:
        print(f"| sequence-parallel rank {r['rank']} of {args.size} | {r['peak_mib']:.0f} | "
              f"{100 * r['peak_mib'] / one['peak_mib']:.0f}% |")
    worst = max(r["peak_mib"] for r in split) / one["peak_mib"]
    print(f"ratio peak per rank, {args.size} sequence-parallel ranks vs one rank: {worst:.2f}x (target <= 0.60)")
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        raise SystemExit(main())
    raise SystemExit(doc_table.run(main, doc_table.table_and("ratio"), doc=doc_table.ROOT / "docs" / "multigpu.md"))
