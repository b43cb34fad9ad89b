"""Tokens/s of verl's rollout sampler against Hugging Face ``model.generate`` on the same work.

Both sample (temperature 1.0, top_p 1.0, no top-k) the same number of new tokens for the same
left-padded batch; eos stopping is off in both so each produces exactly batch * new_tokens tokens.
Run by hand: ``python benchmarks/rollout.py [--batch 64 --new-tokens 64 --threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import add_cpu_matmul_argument  # noqa: E402


def _tiny_model(vocab: int, seed: int) -> torch.nn.Module:
    """The project's tiny model when available, else a random Qwen2 of the same shape."""
    try:
        from verl.models.tiny import build_tiny_model
    except ImportError:
        build_tiny_model = None
    if build_tiny_model is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=seed), dtype=torch.float32)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths between prompt_len/2 and prompt_len."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=g)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (batch,), generator=g)
    mask = (torch.arange(prompt_len) >= (prompt_len - lengths).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 0), mask


def _seconds(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (HF: num_return_sequences)")
    parser.add_argument("--cpu-time", action="store_true", help="time with this process's CPU time instead of "
                        "wall time: at 1 thread the same work, but not inflated by time spent descheduled on "
                        "a loaded machine")
    parser.add_argument("--update-weights", action="store_true", help="change every weight in place (untimed) "
                        "before each rollout, as an optimizer step does, so the sampler cannot reuse its "
                        "weight layout (what an RL step pays)")
    add_cpu_matmul_argument(parser)
    parser.add_argument("--model", default=None, help="tiny[:arch[:hidden[:layers]]] (e.g. tiny:qwen2:256:10 for "
                        "~10M parameters) or a local dir; default: the project's tiny model")
    args = parser.parse_args(argv)

    from verl.rollout import HFKVCacheEngine, SamplingParams

    torch.set_num_threads(args.threads)
    if args.model:
        from dpo import model_dir
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), dtype=torch.float32).eval()
    else:
        model = _tiny_model(vocab=1000, seed=args.seed).eval()
    vocab = model.get_input_embeddings().num_embeddings
    # verl samples with its own copy, whose linear layers use trainer.cpu_matmul's library as in training;
    # generate keeps the model as Hugging Face loads it.
    import copy

    from verl.utils.cpu_matmul import resolve, use_cpu_matmul

    ours_model = use_cpu_matmul(copy.deepcopy(model), resolve(args.cpu_matmul)[0])
    ids, mask = _prompts(args.batch, args.prompt_len, vocab, args.seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                            eos_token_ids=[], pad_token_id=0, n=args.n)
    engine = HFKVCacheEngine(ours_model)
    generator = torch.Generator().manual_seed(args.seed)

    def ours() -> None:
        out = engine.generate(ids, mask, params, generator=generator)
        assert out.response_mask.sum() == args.batch * args.n * args.new_tokens

    def hf() -> None:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=args.new_tokens, min_new_tokens=0,
                                 eos_token_id=None, pad_token_id=0, num_return_sequences=args.n)
        assert out.shape[1] - ids.shape[1] == args.new_tokens and out.shape[0] == args.batch * args.n

    sign = [1.0]

    def update_weights() -> None:
        """A tiny in-place change of every parameter (alternating sign), outside the timed region."""
        if args.update_weights:
            with torch.no_grad():
                for p in ours_model.parameters():
                    p.add_(sign[0] * 1e-6)
            sign[0] = -sign[0]

    def timed(fn) -> float:
        update_weights()
        return _seconds(fn, time.process_time if args.cpu_time else time.perf_counter)

    tokens = args.batch * args.n * args.new_tokens
    results = {}
    times: dict[str, list[float]] = {"hf generate": [], "verl HFKVCacheEngine": []}
    hf(), ours()  # warm-up
    # Interleave the two so load from other processes hits both alike.
    ratios = []
    for r in range(args.repeats):
        pair = [("hf generate", hf), ("verl HFKVCacheEngine", ours)]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            times[name].append(timed(fn))
        ratios.append(times["hf generate"][-1] / times["verl HFKVCacheEngine"][-1])
    print(f"batch {args.batch} x n {args.n}, prompt <= {args.prompt_len}, {args.new_tokens} new tokens, "
          f"sampling T=1.0, {args.threads} thread(s), {args.repeats} repeats, vocab {vocab}"
          f"{', weights changed before every rollout' if args.update_weights else ''}"
          f"{', CPU time' if args.cpu_time else ', wall time'}; verl's cpu_matmul={resolve(args.cpu_matmul)[0]}")
    print(f"{'engine':<24}{'median s':>10}{'best s':>10}{'tokens/s (median)':>20}")
    for name, ts in times.items():
        med = statistics.median(ts)
        results[name] = tokens / med
        print(f"{name:<24}{med:>10.4f}{min(ts):>10.4f}{tokens / med:>20.0f}")
    ratio = results["verl HFKVCacheEngine"] / results["hf generate"]
    print(f"ratio (verl / hf generate): {ratio:.2f}x; per-round median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x); load average "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    return ratio


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main))
