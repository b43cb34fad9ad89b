"""Reward workers overlapping generation against scoring after it, one call at a time: RL step time.

The workload is the tiny model's RL step (an in-process `RLTrainer`, 1 torch thread) with a reward that
sleeps, as a sandbox run or a remote call waits, for so long that scoring the batch one call after another
takes about as long as generating it (calibrated on this host: `--reward-share` x the median generation time,
split over the batch's calls). The responses have long-tailed lengths, as real ones do, so rows finish at
different steps: the tiny model is edited so that every token ends the response with probability
`--stop-prob` (`async_vs_sync.long_tailed_model`). The step is generation-bound, as long-response RL is
(a group of 8 responses of up to 256 tokens): overlap can hide the reward only behind generation, so the gain is at most
(2 x generation + rest) / (generation + rest), and with the update as long as generation (the tiny model's
at `--batch 4 --tokens 128`) that cap is 1.5x.
- baseline: `reward.overlap=false, reward.workers=1`: scoring after generation, one call at a time;
- candidate: the defaults, `reward.overlap=true` with `reward.workers=4`: each response's call starts as
  its row finishes, up to 4 at once (on threads, or with `--set reward.executor=process` in worker
  processes, where waking up takes nothing from the generating thread: see docs/environments.md).
`--set KEY=VALUE` applies to both sides.
Both sides train the same seed and score identically (asserted), so they do the same work. Each round runs
`--steps` steps of each side back to back (interleaved, `ab.interleaved_times`); the ratio line is the median
and min-max of the per-round ratios of baseline to candidate time.
Run by hand: ``python benchmarks/reward_overlap.py [--rounds 15] [--steps 4] [--write-docs]`` (the table is in
docs/environments.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import interleaved_times, load_average, ratios  # noqa: E402
from async_vs_sync import long_tailed_model  # noqa: E402
from sleepy_reward import SleepyReward  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "environments.md"


def trainer(run_dir: Path, model: Path, reward: SleepyReward, args: argparse.Namespace, **reward_cfg: Any) -> Any:
    from verl.config import load_config
    from verl.trainer.rl_trainer import RLTrainer

    overrides = [
        f"model.path={model}", "model.dtype=float32", "trainer.device=cpu", "trainer.cpu_threads=1",
        "env.name=arithmetic", "env.kwargs.max_operand=99", "env.kwargs.num_val=8",
        f"data.train_batch_size={args.batch}", "data.max_prompt_length=16", f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.tokens}", "rollout.temperature=1.0", "actor.lr=1e-6",
        "actor.micro_batch_size=64", "actor.max_tokens_per_micro_batch=4096",
        "logging.backends=[jsonl]", f"trainer.run_dir={run_dir}", "trainer.val_before_train=false",
        "trainer.resume=never", "trainer.seed=1", "checkpoint.save_interval=0",
        *(f"reward.{k}={v}" for k, v in reward_cfg.items()), *args.set,
    ]
    return RLTrainer(load_config(overrides=overrides), reward_functions=[reward])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="RL steps of each side per round")
    parser.add_argument("--batch", type=int, default=1, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--tokens", type=int, default=256, help="rollout.max_new_tokens")
    parser.add_argument("--stop-prob", type=float, default=0.01, help="each token ends the response with this")
    parser.add_argument("--calibrate", type=int, default=5, help="steps (after 2 warm-up steps) timing generation")
    parser.add_argument("--reward-share", type=float, default=1.0,
                        help="serial reward time as a multiple of the generation time")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides for both sides (e.g. actor.remove_padding=true)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reward = SleepyReward(root / "delay")
        model = long_tailed_model(root / "model", args.stop_prob)
        sides = {"baseline": trainer(root / "baseline", model, reward, args, overlap="false", workers=1),
                 "candidate": trainer(root / "candidate", model, reward, args)}
        generation = [sides["baseline"].step()["timing/generate"] for _ in range(2 + args.calibrate)][2:]
        for _ in range(2 + args.calibrate):  # the candidate draws the same batches
            sides["candidate"].step()
        samples = args.batch * args.n

        def calibrate() -> None:  # the serial reward time: --reward-share x the baseline's recent generation time
            reward.delay = args.reward_share * statistics.median(generation[-2 * args.steps:]) / samples

        calibrate()
        print(f"calibration: generation {statistics.median(generation[-2 * args.steps:]) * 1000:.1f} ms per step; "
              f"reward {reward.delay * 1000:.2f} ms per call x {samples} calls "
              f"(recalibrated after each baseline round)",
              flush=True)
        stages: dict[str, list[dict[str, float]]] = {name: [] for name in sides}

        def steps(name: str) -> None:
            for _ in range(args.steps):
                stages[name].append(sides[name].step())
            if name == "baseline":  # generation times drift as the policy trains (and with the host's load)
                generation.extend(r["timing/generate"] for r in stages[name][-args.steps:])
                calibrate()

        times = interleaved_times({name: (lambda name=name: steps(name)) for name in sides}, args.rounds)
        for a, b in zip(stages["baseline"], stages["candidate"], strict=True):  # the same work on both sides
            assert a["reward/mean"] == b["reward/mean"], (a["reward/mean"], b["reward/mean"])
    means = {name: {k: statistics.mean(r[f"timing/{k}"] for r in rows) * 1000 for k in ("generate", "reward", "step")}
             for name, rows in stages.items()}
    for name, m in means.items():
        print(f"{name}: mean ms per step: generate {m['generate']:.0f}, reward {m['reward']:.0f}, "
              f"step {m['step']:.0f}; "
              f"response length {statistics.mean(r['response/length_mean'] for r in stages[name]):.1f} mean",
              flush=True)
    base, cand = means["baseline"], means["candidate"]
    saved = base["step"] - cand["step"]
    bound = base["step"] / (base["step"] - base["reward"])  # every reward call hidden behind generation
    print(f"hidden: {saved:.0f} of the {base['reward']:.0f} ms of serial reward time per step "
          f"({100 * saved / base['reward']:.0f}%); hiding all of it would give {bound:.2f}x here (the rest of the "
          f"step, {base['step'] - base['generate'] - base['reward']:.0f} ms, is not overlapped)")
    result = ratios(times["baseline"], times["candidate"])
    processes = "reward.executor=process" in args.set
    print(f"ratio overlap+workers=4 ({'worker processes' if processes else 'threads'}) vs after-generation workers=1 "
          f"(step time): median {result['ratio']:.2f}x "
          f"(min {result['ratio_min']:.2f}x, max {result['ratio_max']:.2f}x) over {args.rounds} rounds of "
          f"{args.steps} steps; {result['baseline_s'] / args.steps * 1000:.0f} vs "
          f"{result['candidate_s'] / args.steps * 1000:.0f} ms per step (generation {base['generate']:.0f} vs "
          f"{cand['generate']:.0f} ms), serial reward "
          f"{base['reward'] / base['generate']:.2f}x generation, upper bound {bound:.2f}x; "
          f"load average {load_average()}")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc=DOC))
