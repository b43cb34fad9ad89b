"""One sampling step (`verl.rollout.sampling.sample_step`: token ids and their log-probs from a row of
logits) against the same step drawing from `exp(log_softmax)`, as it did before.

Run by hand (not a test):
    python benchmarks/sampler.py [--rows 16] [--vocab 768,32000] [--scales 1,30] [--rounds 9] [--repeats 500]
Temperature 1, no top-k/top-p. `--scales` sets the logits' standard deviation: 1 is an untrained model's
flat distribution, 30 a trained policy's peaked one (log-probs far below -87, whose float32 exp underflows).
Rounds are interleaved at 1 torch thread (benchmarks/ab.py); printed: the median (min–max) of the
per-round ratio before/now (> 1: now is faster), and how often the two drew different tokens from the same
uniform numbers (float rounding of the CDF, ~never).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import cpu_model, interleaved, ratio_line  # noqa: E402

from verl.rollout.sampling import filtered_logprobs, sample_from_logprobs, sample_step  # noqa: E402


def step_via_exp(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logp = filtered_logprobs(logits, 1.0)
    tokens = sample_from_logprobs(logp, generator)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def bench(rows: int, vocab: int, scale: float, rounds: int, repeats: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * scale
    same = sum(bool(torch.equal(sample_step(logits, 1.0, None, 1.0, torch.Generator().manual_seed(s))[0],
                                step_via_exp(logits, torch.Generator().manual_seed(s))[0])) for s in range(200))
    g = torch.Generator().manual_seed(1)

    def run(fn):
        for _ in range(repeats):
            fn()

    result = interleaved(lambda: run(lambda: step_via_exp(logits, g)),
                         lambda: run(lambda: sample_step(logits, 1.0, None, 1.0, g)), rounds)
    print(f"[{rows} x {vocab}, logits std {scale:g}] identical tokens in {same}/200 seeded draws")
    print(ratio_line("sample_step", result, "exp(log_softmax)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", default="768,32000")
    parser.add_argument("--scales", default="1,30")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
          f"torch {torch.__version__}, 1 thread")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for scale in (float(s) for s in args.scales.split(",")):
            bench(args.rows, vocab, scale, args.rounds, args.repeats)


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.prefixed("[", "ratio")))
