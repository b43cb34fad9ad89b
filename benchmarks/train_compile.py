"""Experiment for a training `compile` option: the update's forward and backward with the policy under
`torch.compile` against the eager model, on the same batch (what TRL's `torch_compile` and verl's
`use_torch_compile` offer).

One side is `verl.trainer.forward.logprobs.response_logprobs` (the actor's log-probs and entropy of a GRPO
batch's responses, through the Hugging Face model) and a backward of their sum, on the eager model; the other
is the same on `torch.compile(model)` (default inductor settings, static shapes: every round has the same
batch). Prints the first compiled call (compilation included), both sides' seconds per pass as interleaved
rounds at 1 thread, the largest log-prob difference, and a ratio line. Inductor's cache starts empty (a fresh
TORCHINDUCTOR_CACHE_DIR unless one is set), so the first pass counts the whole compilation. Run:
``python benchmarks/train_compile.py --model tiny:qwen2:256:10``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import interleaved, ratio_line  # noqa: E402
from dpo import model_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="verl-inductor-"))
    from transformers import AutoModelForCausalLM

    from verl.trainer.forward.logprobs import response_logprobs
    from verl.utils.positions import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    width = args.prompt_tokens + args.new_tokens
    ids = torch.randint(5, model.config.vocab_size, (args.rows, width), generator=generator)
    mask = torch.ones_like(ids)
    positions = position_ids_from_mask(mask)

    def update_pass(m: torch.nn.Module) -> torch.Tensor:
        logprobs, _ = response_logprobs(m, ids, mask, positions, args.new_tokens, with_entropy=True,
                                        entropy_grad=False)
        logprobs.sum().backward()
        return logprobs.detach()

    compiled = torch.compile(model)
    start = time.perf_counter()
    first = update_pass(compiled)
    first_s = time.perf_counter() - start
    difference = (first - update_pass(model)).abs().max().item()
    result = interleaved(lambda: update_pass(model), lambda: update_pass(compiled), args.rounds)
    print(f"{args.model}, {args.rows} rows x {width} tokens ({args.new_tokens} scored), 1 thread: first compiled "
          f"pass {first_s:.1f} s (compilation); largest log-prob difference {difference:.1e}")
    print(ratio_line("compiled", result, "eager") + f"; first compiled pass {first_s:.1f} s")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc=doc_table.ROOT / "docs" / "optimizations.md"))
