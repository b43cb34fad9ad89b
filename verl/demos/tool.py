"""The tool-use demo: a tiny model learns to call a calculator mid-answer for products it cannot do in its head.

`verl train examples/tool_calculator.yaml [key=value ...]` (the config's `trainer.demo: tool`), or
`python -m verl.demos.tool examples/tool_calculator.yaml [key=value ...]`.

A short supervised warm start on a handful of formatted episodes (`347*29=` -> `<calc>347*29</calc>
<result>10063</result> 10063`) teaches the format and the first copies of operands and result; GRPO on
multi-turn episodes then makes them reliable. The observation (` <result>...`) is the environment's, so
it is masked out of the warm start's loss as out of the RL loss: a product the model cannot compute is
not a token to learn (trained on, it left most tool calls wrong). Before and after RL, greedy episodes on the
held-out problems give the accuracy and the share of episodes whose tool call computed the right product;
`summary.json` in the run directory holds them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from verl.config.schema import RunConfig
from verl.demos.arithmetic import constant_lr_sft, recipe_main, run_summary, sft_until
from verl.env.calculator import CalculatorEnv
from verl.errors import ConfigError
from verl.trainer.rl_trainer import RLTrainer

# The warm start's episodes: a handful, from the training split only.
DEFAULT_SFT_EPISODES = 64
# The warm start stops once greedy episodes answer this share of PROBE_PROBLEMS other *training* problems,
# checked every SFT_CHECK_EVERY steps. Copying the operands and then the result is learnt abruptly, so it is
# checked often; run to its whole budget the warm start leaves RL too little to gain. Stopped on correct tool
# calls alone (before the copy) the policy is still too flat for sampling at temperature 1 and GRPO collapses.
SFT_TARGET_ACCURACY = 0.2
SFT_CHECK_EVERY = 5
PROBE_PROBLEMS = 64


def tool_eval(trainer: RLTrainer, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Greedy episodes on `rows`: accuracy, share with a correct tool call, tool calls per episode."""
    params = trainer._sampling_params(0.0, 1)
    generator = torch.Generator(device=trainer.device).manual_seed(0)
    correct = calls_ok = calls = 0
    size = trainer.config.data.val_batch_size
    for start in range(0, len(rows), size):
        out = trainer.multiturn.run(rows[start : start + size], 1, params, generator)
        correct += sum(int(bool(e.state.get("correct"))) for e in out.episodes)
        calls_ok += sum(int(e.state.get("correct_calls", 0) > 0) for e in out.episodes)
        calls += sum(e.tool_calls for e in out.episodes)
    n = max(len(rows), 1)
    return {"accuracy": correct / n, "tool_calls_correct": calls_ok / n, "tool_calls_per_episode": calls / n}


def run_tool_demo(config: RunConfig, sft_episodes: int = DEFAULT_SFT_EPISODES, quiet: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    say = (lambda *a: None) if quiet else print
    trainer = RLTrainer(config)
    env = trainer.env
    if not isinstance(env, CalculatorEnv):
        raise ConfigError(f"the tool demo trains on env.name: calculator, got {type(env).__name__}; use "
                          "examples/tool_calculator.yaml.")
    say(f"verl tool demo: tiny {trainer.model.config.model_type} model "
        f"({sum(p.numel() for p in trainer.model.parameters()):,} parameters), {len(env)} training problems "
        f"({env.train_problems[0][0]}*{env.train_problems[0][1]}=...), {len(env.val_rows())} held out; "
        f"tool <calc>a*b</calc> -> <result>...</result>")
    demos = env.demonstration_problems(sft_episodes, config.trainer.seed)
    eos = trainer.sampling.eos_token_ids[0]
    examples = [trainer.multiturn.example(*env.formatted_episode(p), eos) for p in demos]
    shown = set(demos)
    rest = [p for p in env.train_problems if p not in shown]
    pick = np.random.default_rng([config.trainer.seed, 4]).choice(len(rest), size=min(PROBE_PROBLEMS, len(rest)),
                                                                  replace=False)
    probe = [env.problem_row(rest[int(i)]) for i in pick]
    t0 = time.perf_counter()
    max_sft = config.sft.steps or 200
    sft = constant_lr_sft(trainer, train_examples=examples)
    sft_steps, train_acc, history = sft_until(sft, lambda: tool_eval(trainer, probe)["accuracy"],
                                              SFT_TARGET_ACCURACY, max_sft, SFT_CHECK_EVERY)
    sft_seconds = time.perf_counter() - t0
    val = env.val_rows()
    before = tool_eval(trainer, val)
    say(f"warm start: {sft_steps} SFT steps on {len(examples)} formatted episodes (stopped at "
        f"{SFT_TARGET_ACCURACY:.0%} greedy accuracy on {len(probe)} other training problems or {max_sft} steps: "
        f"{train_acc:.0%}), loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} ({sft_seconds:.0f}s); "
        f"held-out accuracy {before['accuracy']:.1%}, correct tool calls {before['tool_calls_correct']:.1%}; "
        "now GRPO on multi-turn episodes")
    t0 = time.perf_counter()
    trainer.fit()
    rl_seconds = time.perf_counter() - t0
    after = tool_eval(trainer, val)
    summary = run_summary(
        trainer, start, sft_seconds, rl_seconds, before["accuracy"], after["accuracy"],
        tool_calls_correct_after_sft=before["tool_calls_correct"],
        tool_calls_correct_after_rl=after["tool_calls_correct"],
        tool_calls_per_episode_after_sft=before["tool_calls_per_episode"],
        tool_calls_per_episode_after_rl=after["tool_calls_per_episode"],
        sft_steps=sft_steps, sft_episodes=len(examples), sft_probe_accuracy=train_acc)
    path = trainer.write_summary(summary)
    say(f"held-out accuracy      after SFT {before['accuracy']:6.1%}   after GRPO {after['accuracy']:6.1%}   "
        f"({(after['accuracy'] - before['accuracy']) * 100:+.1f} points)")
    say(f"correct tool calls     after SFT {before['tool_calls_correct']:6.1%}   after GRPO "
        f"{after['tool_calls_correct']:6.1%}")
    say(f"wall time {summary['wall_seconds']:.0f}s; summary: {path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    return recipe_main(argv, "tool", "examples/tool_calculator.yaml", run_tool_demo)


if __name__ == "__main__":
    raise SystemExit(main())
