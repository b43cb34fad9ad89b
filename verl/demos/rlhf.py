"""The RLHF pipeline demo: SFT warm start -> a reward model trained on preferences -> GRPO on that reward alone.

`verl train examples/rlhf_pipeline.yaml [key=value ...]` (the config's `trainer.demo: rlhf`). The task is the
built-in demo's (`47+8=` -> `55`). The three stages of classic RLHF, each with verl's own trainer:

1. SFT (`SFTTrainer`) on the training problems' answers, stopped once greedy accuracy on training problems it
   does not train on reaches `SFT_TARGET_ACCURACY`, as in the arithmetic demo;
2. a reward model (`RMTrainer`, `trainer.kind: rm`) started from the SFT model, on synthetic preferences
   built from the training problems: the correct sum preferred to answers the SFT policy itself samples
   when they are wrong and to near misses (the labeller is the ground truth here, a person in real RLHF),
   trained until its pair accuracy on training problems it does not train on reaches `RM_TARGET_ACCURACY`
   (`trainer.stop_when`), and exported as an `AutoModelForSequenceClassification` folder;
3. GRPO (`RLTrainer`) whose only reward is that folder (`reward.model_path`): no rule scores a training
   sample. Validation scores with `reward.val_functions` (numeric_match), so the held-out accuracy before
   and after RL is the true one, not the reward model's opinion.

`summary.json` holds the accuracies, the reward model's pair accuracy on held-out problems and the stage times;
`samples.jsonl` the validation answers with the reward model's score of each (`training_reward`): with the KL
term off, look there for reward hacking (docs/demos.md).
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

import torch
from rich.console import Console

from verl.config import load_config
from verl.config.schema import RunConfig
from verl.demos.arithmetic import SFT_TARGET_ACCURACY, run_summary, warm_start_until
from verl.errors import ConfigError
from verl.rewards.builtin import extract_number
from verl.rollout import SamplingParams
from verl.rollout.weight_sync import ready_to_sample
from verl.tracking.console import ConsoleReporter, format_points
from verl.trainer.offline.rm_trainer import RMTrainer
from verl.trainer.rl_trainer import RLTrainer

# Answers the SFT policy samples per training problem (temperature 1) to find its wrong answers: the
# rejected side of the preference pairs, so the reward model learns on the mistakes RL will meet. Many and
# varied wrong answers per problem make it learn to check a sum rather than to recall a few: with 8 samples
# it fitted its own training pairs far worse than with 32.
SAMPLES_PER_PROBLEM = 32
# Wrong answers every problem gets as well as the policy's own: a reward model that only saw the SFT policy's
# mistakes (mostly the units digit) did not learn to check the tens digit, and GRPO then drifted to sums off
# by ten that it scored as high as the right ones (docs/demos.md).
NEAR_MISSES = (-10, -1, 1, 10)
# The reward model trains until it ranks this share of the pairs of RM_PROBE_PROBLEMS training problems it
# does not train on correctly (checked every RM_CHECK_EVERY steps), or for RM_STEPS optimizer steps of
# RM_BATCH_SIZE pairs (learning rate rm.lr, decaying over RM_STEPS as actor.* says). A fixed 600 steps left one
# seed's reward model at 91% held-out pair accuracy, still climbing, and GRPO on it stayed under the demo's bar;
# seeds that learn faster stop sooner. (Pair accuracy is a floor, not a forecast: GRPO's gain on reward models of
# similar accuracy still varies by seed.) Large batches at a high rate fit the pairs fastest on a CPU.
RM_TARGET_ACCURACY = 0.97
RM_PROBE_PROBLEMS = 64
RM_CHECK_EVERY = 50
RM_STEPS = 1200
RM_BATCH_SIZE = 256


def policy_answers(trainer: RLTrainer, rows: list[dict[str, Any]], n: int, seed: int) -> list[list[str]]:
    """`n` sampled answers (temperature 1, as RL samples) per row from the trainer's current policy."""
    r = trainer.config.rollout
    params = SamplingParams(temperature=1.0, top_p=r.top_p, top_k=r.top_k or None, max_new_tokens=r.max_new_tokens,
                            n=n, eos_token_ids=trainer.eos_token_ids, pad_token_id=trainer.tokenizer.pad_token_id)
    generator = torch.Generator(device=trainer.device).manual_seed(seed)
    out: list[list[str]] = []
    size = max(1, trainer.config.data.val_batch_size // n)  # rows per generate call
    for start in range(0, len(rows), size):
        ids, mask = trainer.encode_prompts(rows[start : start + size])
        with ready_to_sample(trainer.engine, trainer.model, trainer.gathered):
            gen = trainer.engine.generate(ids.to(trainer.device), mask.to(trainer.device), params, generator=generator)
        texts = trainer.decode_responses(gen.response_ids, gen.response_mask)
        out += [texts[i : i + n] for i in range(0, len(texts), n)]
    return out


def preference_pairs(rows: list[dict[str, Any]], answers: list[list[str]],
                     near_misses: tuple[int, ...] = NEAR_MISSES) -> list[dict[str, Any]]:
    """(prompt, correct answer, wrong answer) pairs: every distinct wrong answer the policy gave, and the near
    misses `near_misses` away from the sum (a wrong units digit, a wrong tens digit), so that the reward model
    must check every digit and not only the ones the SFT policy tends to get wrong."""
    pairs = []
    for row, texts in zip(rows, answers, strict=True):
        truth = row["ground_truth"]
        value = extract_number(truth)
        wrong = {t for t in texts if t.strip() and extract_number(t) != value}
        if value is not None:
            wrong |= {str(int(value) + d) for d in near_misses if int(value) + d >= 0}
        pairs += [{"prompt": row["prompt"], "chosen": truth, "rejected": w} for w in sorted(wrong)]
    return pairs


def run_rlhf_demo(config: RunConfig, *, rm_steps: int = RM_STEPS, rm_batch_size: int = RM_BATCH_SIZE,
                  samples_per_problem: int = SAMPLES_PER_PROBLEM, near_misses: tuple[int, ...] = NEAR_MISSES,
                  quiet: bool = False) -> dict[str, Any]:
    """The three stages on `config` (`examples/rlhf_pipeline.yaml`); the keyword arguments shrink the reward
    model's stage for tests, or (`near_misses=()`) train it on the SFT policy's own mistakes only, the reward
    model whose blind spot GRPO exploits (benchmarks/rlhf_seeds.py). Returns (and writes to
    `<run_dir>/summary.json`) the before/after accuracies."""
    start = time.perf_counter()
    if config.reward.functions:
        raise ConfigError("the RLHF demo trains on the reward model alone, but reward.functions="
                          f"{[f.get('name') for f in config.reward.functions]} would add a rule-based reward. Fix: "
                          "remove reward.functions (validation scores with reward.val_functions)")
    # Stage 1 runs on an RL trainer without a reward model (it probes accuracy with the env's numeric_match).
    warm_reward = config.reward.model_copy(update={"model_path": None, "val_functions": []})
    trainer = RLTrainer(config.model_copy(update={"reward": warm_reward}))
    env, run_dir = trainer.env, trainer.run_dir
    if not callable(getattr(env, "sft_pairs", None)):
        raise ConfigError(f"trainer.demo=rlhf builds its preferences from the arithmetic environment's problems; "
                          f"{type(env).__name__} has none. Use env.name: arithmetic")
    console = Console(quiet=quiet or trainer.rank != 0)
    console.print(f"[bold]verl RLHF demo[/]: tiny {trainer.model.config.model_type} model, {len(env)} arithmetic "
                  f"problems, {len(env.val_rows())} held out: SFT -> reward model -> GRPO on the reward model")
    # 1. SFT warm start
    t0 = time.perf_counter()
    max_sft = config.sft.steps or 1500
    warm = ConsoleReporter(max_sft, label="1/3 SFT step", enabled=trainer.rank == 0 and not quiet)
    warm.start(0)
    try:
        sft_steps, train_acc, _ = warm_start_until(trainer, SFT_TARGET_ACCURACY, max_sft, progress=warm)
    finally:
        warm.stop()
    sft_seconds = time.perf_counter() - t0
    console.print(f"1/3 SFT: {sft_steps} steps, greedy accuracy on training problems {train_acc:.0%} "
                  f"({sft_seconds:.0f}s)")
    # 2. the reward model, from the SFT model, on the policy's own mistakes and the near misses
    t0 = time.perf_counter()
    rows = [{"prompt": prompt, "ground_truth": answer} for prompt, answer in env.sft_pairs()]
    held_out = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in env.val_rows()]
    pairs = preference_pairs(rows, policy_answers(trainer, rows, samples_per_problem, config.trainer.seed),
                             near_misses)
    # The pairs of a few training problems decide when it stops (trainer.stop_when), and it never trains on them
    probed = {r["prompt"] for r in rows[:min(RM_PROBE_PROBLEMS, len(rows) // 4)]}
    probe_pairs = [p for p in pairs if p["prompt"] in probed]
    train_pairs = [p for p in pairs if p["prompt"] not in probed]
    # Pairs on the held-out problems only measure the reward model (nothing trains or stops on them).
    val_pairs = preference_pairs(held_out, policy_answers(trainer, held_out, samples_per_problem,
                                                          config.trainer.seed + 1), NEAR_MISSES)
    rm_config = config.model_copy(update={
        "trainer": config.trainer.model_copy(update={
            "kind": "rm", "demo": None, "run_dir": str(run_dir / "rm"), "total_steps": rm_steps,
            "val_every": RM_CHECK_EVERY, "val_before_train": False,
            "stop_when": f"val/accuracy>={RM_TARGET_ACCURACY}"}),
        "data": config.data.model_copy(update={"train_batch_size": rm_batch_size}),
        "actor": config.actor.model_copy(update={"micro_batch_size": 2 * rm_batch_size}),
        "reward": warm_reward})
    # A copy: the reward model starts from the SFT weights, and training it must not change the policy.
    rm = RMTrainer(rm_config, model=copy.deepcopy(trainer.model), tokenizer=trainer.tokenizer, train_rows=train_pairs,
                   val_rows=probe_pairs)
    rm_history = rm.fit()
    rm_path, rm_steps_taken = rm.export_dir, rm.step_count
    probe_accuracy = [h["val/accuracy"] for h in rm_history if "val/accuracy" in h][-1]
    rm_accuracy = rm.evaluate(val_pairs)["accuracy"]
    rm_seconds = time.perf_counter() - t0
    console.print(f"2/3 reward model: {rm_steps_taken} steps on {len(train_pairs)} pairs, accuracy on its probe "
                  f"pairs {probe_accuracy:.1%}, on held-out problems' pairs {rm_accuracy:.1%} ({rm_seconds:.0f}s); "
                  f"exported to {rm_path}")
    del rm
    # 3. GRPO whose only reward is the reward model; validation measures the true accuracy
    t0 = time.perf_counter()
    rl_config = config.model_copy(update={
        "reward": config.reward.model_copy(update={"model_path": str(rm_path)}),
        "trainer": config.trainer.model_copy(update={"run_dir": str(run_dir)})})
    rl = RLTrainer(rl_config, model=trainer.model, tokenizer=trainer.tokenizer)
    del trainer
    history = rl.fit()
    rl_seconds = time.perf_counter() - t0
    val = [h for h in history if "val/accuracy" in h]
    before, after = val[0]["val/accuracy"], val[-1]["val/accuracy"]
    rewards = [h["reward/reward_model/score"] for h in history if "reward/reward_model/score" in h]
    summary = run_summary(
        rl, start, sft_seconds, rl_seconds, before, after, rm_pair_accuracy=rm_accuracy,
        rm_probe_accuracy=probe_accuracy, rm_steps=rm_steps_taken, rm_pairs=len(train_pairs),
        rm_reward_first_step=rewards[0] if rewards else None, rm_reward_last_step=rewards[-1] if rewards else None,
        kl_loss_coef=config.actor.kl_loss_coef, near_misses=list(near_misses), sft_steps=sft_steps,
        rm_seconds=rm_seconds, reward_model=str(rm_path))
    path = rl.write_summary(summary)
    console.print(f"3/3 GRPO on the reward model: true held-out accuracy {before:.1%} -> {after:.1%} "
                  f"({format_points(after - before)}), {rl.step_count} steps ({rl_seconds:.0f}s); "
                  f"wall time {summary['wall_seconds']:.0f}s")
    console.print(f"run directory: {run_dir}  (summary: {path}, validation answers: samples.jsonl)", markup=False)
    return summary


def main(argv: list[str] | None = None) -> int:
    """`python -m verl.demos.rlhf CONFIG [--no-near-misses] [key=value ...]`: `verl train CONFIG`, or with a reward
    model trained on the SFT policy's own mistakes only."""
    args = list(sys.argv[1:] if argv is None else argv)
    plain = "--no-near-misses" in args
    args = [a for a in args if a != "--no-near-misses"]
    if not args or "=" in args[0]:
        print("usage: python -m verl.demos.rlhf examples/rlhf_pipeline.yaml [--no-near-misses] [key=value ...]",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    run_rlhf_demo(load_config(args[0], overrides=args[1:]), near_misses=() if plain else NEAR_MISSES)
    return 0


__all__ = ["NEAR_MISSES", "main", "preference_pairs", "policy_answers", "run_rlhf_demo"]


if __name__ == "__main__":
    raise SystemExit(main())
