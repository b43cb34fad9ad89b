"""Rollout of an FSDP2-sharded policy: the lean decode step (weights gathered once for the rollout) against the
model's own ``forward`` with FSDP2's hooks on every decode step, which is what a sharded policy used before.

One process joins a 1-rank gloo group and shards the project's tiny model with ``fully_shard`` as the trainer
does; both sides sample the same prompts inside ``verl.distributed.fsdp.gathered`` (greedy, eos off, so each
writes batch x new_tokens tokens), in interleaved rounds. Run by hand:
``python benchmarks/fsdp_rollout.py [--batch 32 --new-tokens 32 --rounds 7] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_table  # noqa: E402
from ab import interleaved, ratio_line  # noqa: E402
from rollout import _prompts, _tiny_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from verl.distributed.fsdp import apply_fsdp, gathered
    from verl.rollout import HFKVCacheEngine, SamplingParams
    from verl.trainer.fsdp_config import FSDPConfig

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            model = _tiny_model(vocab=0, seed=0)
            vocab = model.get_input_embeddings().num_embeddings
            model = apply_fsdp(model, FSDPConfig(), group=dist.group.WORLD, device_type="cpu").eval()
            ids, mask = _prompts(args.batch, args.prompt_len, vocab, seed=1)
            params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
            fast, plain = HFKVCacheEngine(model), HFKVCacheEngine(model, fast_decode=False)
            with gathered(model):
                assert fast.fast_decode_reason == "", fast.fast_decode_reason
                same = torch.equal(fast.generate(ids, mask, params).response_ids,
                                   plain.generate(ids, mask, params).response_ids)
                result = interleaved(lambda: plain.generate(ids, mask, params),
                                     lambda: fast.generate(ids, mask, params), rounds=args.rounds)
        finally:
            dist.destroy_process_group()
    tokens = args.batch * args.new_tokens
    print(f"FSDP2 (1-rank gloo), tiny model, batch {args.batch} x {args.new_tokens} new tokens, "
          f"{args.threads} thread(s); same greedy tokens: {same}")
    print(f"tokens/s: forward with FSDP2 hooks {tokens / result['baseline_s']:.0f}, "
          f"lean decode step {tokens / result['candidate_s']:.0f}")
    print(ratio_line("lean decode step", result, "forward with FSDP2 hooks"))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(doc_table.run(main, doc=doc_table.ROOT / "docs" / "multigpu.md"))
