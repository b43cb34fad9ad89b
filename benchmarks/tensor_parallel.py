"""Peak memory per rank and step time of a training step: one rank against T=2 tensor-parallel ranks
(`actor.tensor_parallel_size`, verl.distributed.tensor_parallel), at Qwen2.5-0.5B's shape by default.

Run by hand (not a test):
``python benchmarks/tensor_parallel.py [--tokens 512 --steps 3 --layers 24 --hidden 896 ...] [--write-docs]``

Each side runs in fresh child processes (one per rank; the ranks join a gloo group), CPU, float32, one torch
thread per rank. A child takes its resident memory after the imports (and the group) as its baseline, builds the
model on the meta device, splits it (TP side), gives it storage with random weights, then takes `--steps`
training steps: the actor's log-probs and entropy of one `--tokens`-token sequence (vocabulary-parallel on the TP
side, from the whole logits on one rank), a GRPO-like loss, backward, and an AdamW step (whose first step makes
the two moments). Its peak is `ru_maxrss` minus the baseline: weights, gradients, optimizer moments and the
step's activations and logits, everything a rank holds for training. The step time is the median of the steps
after the first. On this CPU the two ranks share the machine's cores, one each.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_table  # noqa: E402
from rank_children import rss_kib, run_ranks  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One rank: baseline, build, train `--steps` steps; print one JSON line."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.algorithms import token_logprobs_and_entropy
    from verl.distributed.tensor_parallel import apply_tensor_parallel, clip_grad_norm_, vocab_parallel_logprobs

    torch.set_num_threads(1)
    size = args.size if args.rank is not None else 1
    mesh = None
    if size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=size)
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    baseline = rss_kib()
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.tokens + 64, tie_word_embeddings=True, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).float()
    if mesh is not None:
        apply_tensor_parallel(model, mesh)
    model.to_empty(device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight  # to_empty gave each module a tensor of its own
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02)
        rotary = type(model.model.rotary_emb)(config=cfg)  # its frequencies: meta construction left them empty
        for name, buffer in model.model.rotary_emb.named_buffers():
            buffer.copy_(rotary.get_buffer(name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (1, args.tokens), generator=g)
    advantages = torch.randn(1, args.tokens - 1, generator=g)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        logits = model(input_ids=ids[:, :-1]).logits
        if mesh is not None:
            logprobs, entropy = vocab_parallel_logprobs(logits, ids[:, 1:], temperature=1.0)
        else:
            logprobs, entropy = token_logprobs_and_entropy(logits, ids[:, 1:], temperature=1.0)
        (-(logprobs * advantages).mean() - 0.01 * entropy.mean()).backward()
        del logits, logprobs, entropy
        if mesh is not None:
            clip_grad_norm_(model.parameters(), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rank": args.rank or 0, "peak_mib": (high - baseline) / 1024,
                      "step_s": statistics.median(times[1:] or times),
                      "params": sum(p.numel() for p in model.parameters())}), flush=True)
    if mesh is not None:
        dist.destroy_process_group()


def _shape_args(args: argparse.Namespace) -> list[str]:
    return ["--tokens", str(args.tokens), "--steps", str(args.steps), "--layers", str(args.layers), "--hidden",
            str(args.hidden), "--intermediate", str(args.intermediate), "--heads", str(args.heads), "--kv-heads",
            str(args.kv_heads), "--vocab", str(args.vocab)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="one sequence's length")
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first makes the optimizer state)")
    parser.add_argument("--size", type=int, default=2, help="tensor-parallel ranks")
    # Qwen2.5-0.5B's shape (tied embeddings)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
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
    print(f"{args.steps} training steps (log-probs and entropy of 1 sequence of {args.tokens} tokens, a GRPO-like "
          f"loss, AdamW) of a Qwen2-shaped model: {one['params'] / 1e6:.0f}M parameters, {args.layers} layers, "
          f"hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV), vocab {args.vocab}, tied embeddings; "
          "CPU float32, 1 thread per rank")
    print("| run | peak MiB (weights, grads, AdamW, step) | share of one rank | step s |")
    print("|---|---|---|---|")
    print(f"| one rank | {one['peak_mib']:.0f} | 100% | {one['step_s']:.1f} |")
    for r in split:
        print(f"| tensor-parallel rank {r['rank']} of {args.size} | {r['peak_mib']:.0f} | "
              f"{100 * r['peak_mib'] / one['peak_mib']:.0f}% | {r['step_s']:.1f} |")
    worst = max(r["peak_mib"] for r in split) / one["peak_mib"]
    slowest = max(r["step_s"] for r in split) / one["step_s"]
    print(f"ratio peak per rank, {args.size} tensor-parallel ranks vs one rank: {worst:.2f}x (target <= 0.60)")
    print(f"ratio step time, {args.size} tensor-parallel ranks vs one rank: {slowest:.2f}x")
    return 0


if __name__ == "__main__":
    if "--child" in sys.argv:
        raise SystemExit(main())
    raise SystemExit(doc_table.run(main, doc_table.table_and("ratio"), doc=doc_table.ROOT / "docs" / "multigpu.md"))
