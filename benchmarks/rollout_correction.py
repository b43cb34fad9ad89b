"""Rollout correction on the arithmetic demo: a sampler that lags the policy, with and without the correction.

One supervised warm start (the demo's), then three GRPO runs from the same weights and seed:
  sync        the hf sampler on the live policy (what a synchronous run gets; auto = off, an exact no-op)
  lag         a stand-in sampler `--lag` updates behind (an asynchronous rollout with max_staleness = lag),
              no correction (actor.rollout_correction.mode=off)
  lag+corr    the same sampler with the correction auto turns on for a stale sampler (token_tis, cap 2)
Held-out greedy accuracy (the demo's validation, on the live policy) after `--steps` steps, and the mean
training reward of the last 10 steps (sampled by the lagging sampler in the lagged runs). The on-policy
guard is off in the lagged runs (it would stop them: catching such an engine is its job).
Run: ``python benchmarks/rollout_correction.py [--steps 60] [--lag 1] [--write-docs]`` (docs/training.md).
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_table  # noqa: E402

from verl.config import load_config  # noqa: E402
from verl.demos.arithmetic import SFT_TARGET_ACCURACY, demo_config_path, warm_start_until  # noqa: E402
from verl.rollout import HFKVCacheEngine  # noqa: E402
from verl.trainer.rl.correction import AUTO_MODE  # noqa: E402
from verl.trainer.rl_trainer import RLTrainer  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "training.md"
GUARD_OFF = ["rollout.max_logprob_drift=null", "rollout.drift_noise_ratio=null", "rollout.drift_growth_steps=0"]


def lag_sampler(trainer: RLTrainer, lag: int) -> None:
    """Make the training rollouts sample from the policy as it was `lag` updates ago (validation keeps the
    live policy): a copy of the model, loaded before each rollout with the weights of `lag` steps back."""
    stale = copy.deepcopy(trainer.model)
    engine, live_engine = HFKVCacheEngine(stale), trainer.engine
    history: collections.deque = collections.deque(maxlen=lag + 1)
    generate = trainer.generate

    def lagged_generate(batch):
        history.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        stale.load_state_dict(history[0])  # the oldest kept: `lag` updates back once the run is that far in
        trainer.engine = engine
        try:
            return generate(batch)
        finally:
            trainer.engine = live_engine

    trainer.generate = lagged_generate


def run_arm(name: str, warm: dict, steps: int, lag: int, seed: int, root: Path
            ) -> tuple[float, float, float, float]:
    mode = {"sync": "auto", "lag": "off", "lag+corr": AUTO_MODE}[name]
    overrides = [f"trainer.total_steps={steps}", f"trainer.val_every={steps}", f"trainer.seed={seed}",
                 "trainer.demo=null", f"trainer.run_dir={root / name.replace('+', '_')}", "trainer.resume=never",
                 "logging.backends=[jsonl]", f"actor.rollout_correction.mode={mode}"]
    trainer = RLTrainer(load_config(demo_config_path(), overrides + (GUARD_OFF if name != "sync" else [])))
    trainer.model.load_state_dict(warm)
    if name != "sync":
        lag_sampler(trainer, lag)
    t0 = time.perf_counter()
    history = trainer.fit()
    val = [h["val/accuracy"] for h in history if "val/accuracy" in h]
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h][-10:]
    return val[0], val[-1], sum(rewards) / max(len(rewards), 1), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lag", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="rollout-correction-"))
    config = load_config(demo_config_path(), [f"trainer.seed={args.seed}", f"trainer.run_dir={root / 'warm'}",
                                              "trainer.resume=never", "logging.backends=[jsonl]"])
    trainer = RLTrainer(config)
    sft_steps, acc, _ = warm_start_until(trainer, SFT_TARGET_ACCURACY, config.sft.steps or 1500)
    warm = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    print(f"warm start: {sft_steps} SFT steps, training accuracy {acc:.0%}; GRPO {args.steps} steps per run, "
          f"sampler lag {args.lag} update(s)")
    print("| run | held-out before | after | train reward, last 10 steps | wall s |")
    print("|---|---|---|---|---|")
    results = {}
    for name in ("sync", "lag", "lag+corr"):
        before, after, reward, seconds = run_arm(name, warm, args.steps, args.lag, args.seed, root)
        results[name] = after
        print(f"| {name} | {before:.1%} | {after:.1%} | {reward:.3f} | {seconds:.0f} |", flush=True)
    print(f"ratio: after {args.steps} steps with a sampler {args.lag} update(s) behind, the default correction "
          f"reaches {results['lag+corr']:.1%} (sync {results['sync']:.1%}), without it {results['lag']:.1%}")


if __name__ == "__main__":
    raise SystemExit(doc_table.run(main, doc=DOCS, pick=doc_table.table_and("ratio")))
