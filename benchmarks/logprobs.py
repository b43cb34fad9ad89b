"""Token log-probabilities, forward and backward: `verl.algorithms.token_logprobs` (log_softmax + gather
forward, a softmax backward of its own) against autograd through `logits[label] - logsumexp(logits)` (what
it computed before, and what the float64 tests check both against).

Run by hand (not a test):
    python benchmarks/logprobs.py [--shapes 16x32x768,16x48x32000] [--rounds 9] [--repeats 20]
Each shape is [sequences x positions x vocabulary] of float32 logits with random labels; one call is a
forward and a backward of the sum of the log-probs weighted by random per-token weights (as a loss does).
Rounds are interleaved at 1 torch thread (benchmarks/ab.py); printed: the median (min–max) of the
per-round ratio baseline/ours (> 1: ours is faster) and each side's largest gradient error against the
float64 gradient.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import cpu_model, interleaved, ratio_line  # noqa: E402

from verl.algorithms import token_logprobs  # noqa: E402


def autograd_logsumexp(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def bench_shape(shape: str, rounds: int, repeats: int, scale: float) -> None:
    b, t, v = (int(x) for x in shape.split("x"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g) * scale
    labels = torch.randint(0, v, (b, t), generator=g)
    weights = torch.randn(b, t, generator=g)

    def run(fn, times: int = repeats) -> torch.Tensor:
        for _ in range(times):
            x = logits.detach().requires_grad_(True)
            (fn(x, labels) * weights).sum().backward()
        return x.grad

    # accuracy: each float32 gradient against the float64 one
    x64 = logits.double().requires_grad_(True)
    (autograd_logsumexp(x64, labels) * weights.double()).sum().backward()
    errors = {fn.__name__: float((run(fn, 1).double() - x64.grad).abs().max())
              for fn in (autograd_logsumexp, token_logprobs)}
    result = interleaved(lambda: run(autograd_logsumexp), lambda: run(token_logprobs), rounds)
    print(f"[{shape}] largest float32 gradient error vs float64: "
          + ", ".join(f"{name} {err:.2e}" for name, err in errors.items()))
    print(ratio_line("token_logprobs", result, "autograd logsumexp"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x32x768,16x48x32000")
    parser.add_argument("--scale", type=float, default=3.0, help="standard deviation of the logits")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20, help="calls per side per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
          f"torch {torch.__version__}, 1 thread")
    for shape in args.shapes.split(","):
        bench_shape(shape, args.rounds, args.repeats, args.scale)

if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.prefixed("[", "ratio")))
