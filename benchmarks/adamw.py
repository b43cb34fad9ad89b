"""AdamW step time: torch's fused kernel (what the trainers build, verl/trainer/build/optim.py) against the
foreach implementation and the plain for-loop one, on the parameter sets of the tiny models.

Run by hand (not a test):
    python benchmarks/adamw.py [--models tiny,tiny:qwen2:256:10] [--rounds 7] [--steps 20]
For each model, three AdamW optimizers (same lr, betas, weight decay) hold their own copy of the model's
parameters (float32, with fixed random gradients) and each round times --steps optimizer steps of each,
in rotating order (benchmarks/ab.py). 1 torch thread. Printed per model: the median seconds per step of
each implementation, and the median (min–max) over the rounds of the per-round ratios for-loop/fused
and foreach/fused (> 1: fused is faster). The three give the same parameters (checked after the run).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import cpu_model, interleaved_times, load_average, ratios  # noqa: E402

IMPLEMENTATIONS = {
    "for-loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True}, "fused": {"fused": True}
}


def model_parameters(spec: str) -> list[torch.Tensor]:
    """The trainable parameters (detached) of a `tiny[:arch[:hidden[:layers]]]` spec or a local model dir."""
    from transformers import AutoModelForCausalLM

    from verl.models.hf_loader import quiet_hf_progress
    from verl.trainer.build.models import resolve_model_path

    with quiet_hf_progress():
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(spec), dtype=torch.float32)
    return [p.detach() for p in model.parameters() if p.requires_grad]


def optimizers(params: list[torch.Tensor], seed: int) -> dict[str, torch.optim.AdamW]:
    """One AdamW per implementation, each on its own copy of `params` with the same random gradients."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    out = {}
    for name, kwargs in IMPLEMENTATIONS.items():
        copies = [torch.nn.Parameter(p.clone()) for p in params]
        for c, grad in zip(copies, grads, strict=True):
            c.grad = grad.clone()
        out[name] = torch.optim.AdamW(copies, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, **kwargs)
    return out


def stepper(opt: torch.optim.Optimizer, steps: int):
    def run() -> None:
        for _ in range(steps):
            opt.step()
    return run


def same_parameters(opts: dict[str, torch.optim.AdamW]) -> float:
    """Largest difference of any parameter between the implementations (after the same number of steps)."""
    params = {name: opt.param_groups[0]["params"] for name, opt in opts.items()}
    ref = params["for-loop"]
    with torch.no_grad():
        return max(float((a - b).abs().max()) for ps in params.values() for a, b in zip(ps, ref, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,tiny:qwen2:256:10", help="comma-separated model specs")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per implementation per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = datetime.datetime.now(datetime.timezone.utc)
    print(f"# AdamW: for-loop vs foreach vs fused; torch {torch.__version__}, 1 thread, {cpu_model()}; "
          f"{args.rounds} rounds x {args.steps} steps; start {start:%Y-%m-%d %H:%M} UTC, load average {load_average()}")
    print(f"{'model':<22}{'params':>12}{'for-loop s/step':>17}{'foreach s/step':>16}{'fused s/step':>14}"
          f"{'loop/fused':>24}{'foreach/fused':>24}")
    lines = []
    for spec in args.models.split(","):
        params = model_parameters(spec)
        opts = optimizers(params, args.seed)
        times = interleaved_times({name: stepper(opt, args.steps) for name, opt in opts.items()}, args.rounds)
        diff = same_parameters(opts)
        assert diff < 1e-5, f"{spec}: the implementations disagree by {diff}"
        loop, foreach = ratios(times["for-loop"], times["fused"]), ratios(times["foreach"], times["fused"])
        per_step = {name: statistics.median(t) / args.steps for name, t in times.items()}

        def cell(r):
            return f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"

        print(f"{spec:<22}{sum(p.numel() for p in params):>12,}{per_step['for-loop']:>17.5f}"
              f"{per_step['foreach']:>16.5f}{per_step['fused']:>14.5f}{cell(loop):>24}{cell(foreach):>24}")
        lines.append(f"ratio fused vs for-loop on {spec}: median {cell(loop)}; vs foreach: median {cell(foreach)}")
    end = datetime.datetime.now(datetime.timezone.utc)
    for line in lines:
        print(line)
    print(f"# end {end:%Y-%m-%d %H:%M} UTC, load average {load_average()}")


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main))
