"""The agent demo: OpenAI-client agent code (`examples/agent_calculator.py`) trains a tiny model to call a
calculator in the Hermes tool format, through the trainer's OpenAI-compatible endpoint.

`verl train examples/agent_tools.yaml [key=value ...]` (the config's `trainer.demo: agent`).

A short supervised warm start on formatted conversations (the prompt with the tools listed, the model's
`<tool_call>`, the tool turn, the answer; half of them the answer alone, without the tool), tokenised as the
endpoint stitches an episode: the model's turns each end with eos, the tool turn is the template's (`ToolTurns`)
and masked out of the loss. GRPO on the agent's episodes then learns to call the tool on every problem and to
copy its result reliably. Before and after RL, greedy
episodes of the agent on the held-out problems give the accuracy; `summary.json` holds it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch

from verl.data.chat import encode_prompt
from verl.data.datasets import IGNORE_INDEX
from verl.data.tool_parsers import ToolCall, tool_call_format
from verl.data.tool_template import ToolTurns
from verl.demos.arithmetic import constant_lr_sft, run_summary, sft_until
from verl.env.calculator import CalculatorEnv
from verl.errors import ConfigError
from verl.trainer.rl_trainer import RLTrainer

SFT_EPISODES = 8000  # every training problem but the probe: with fewer, a digit of the answer was learnt by heart
# Half the warm start's conversations answer without the tool (the right product, which the tiny model cannot
# compute in its head): the warm-started policy calls the calculator on some problems and guesses on others, and
# GRPO learns that the tool pays (calls per episode go to 2) while its copying of the result improves. Taught the
# tool alone, where the warm start stopped decided what RL could gain: from some starts GRPO only polished the copy.
SFT_DIRECT_SHARE = 0.5
SFT_TARGET_ACCURACY = 0.4  # greedy accuracy on PROBE_PROBLEMS other training problems that stops the warm start
# Copying is learnt abruptly and, at a constant learning rate, unsteadily (greedy accuracy went 28% -> 3% -> 47% ->
# 72% two steps apart): from 10% on it is checked every 2 steps, and a check over SFT_CEILING goes back to the one
# before and takes its steps again (else a run could start RL at 65%, with less than the demo's 30 points left).
SFT_CHECK_EVERY = 10
SFT_CHECK_NEAR = (0.1, 2)
SFT_CEILING = 0.55
PROBE_PROBLEMS = 64


def agent_eval(trainer: RLTrainer, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Greedy episodes of the agent on `rows`: accuracy (reward 1) and calls per episode."""
    params = trainer._sampling_params(0.0, 1)
    generator = torch.Generator(device=trainer.device).manual_seed(0)
    out = trainer.multiturn.run(rows, 1, params, generator)
    n = max(len(rows), 1)
    return {"accuracy": sum(e.reward == 1.0 for e in out.episodes) / n,
            "calls_per_episode": sum(e.info["agent_calls"] for e in out.episodes) / n}


def conversation_example(trainer: RLTrainer, turns: ToolTurns, row: dict[str, Any], a: int, b: int,
                         tool_format: str, direct: bool = False) -> tuple[list[int], list[int]]:
    """(ids, labels) of a correct episode, laid out as the endpoint stitches one; `direct`: the answer without
    the tool."""
    tok, eos = trainer.tokenizer, trainer.sampling.eos_token_ids[0]
    prompt = encode_prompt(tok, [{"role": "user", "content": row["prompt"]}], "auto", {"tools": turns.tools})
    segments = [(str(a * b), True)]
    if not direct:
        call = tool_call_format(tool_format).format([ToolCall("calculator", {"expression": f"{a}*{b}"})])
        segments = [(call, True), (turns.render([("calculator", str(a * b))]), False), *segments]
    ids, labels = list(prompt), [IGNORE_INDEX] * len(prompt)
    for text, from_model in segments:
        seg = list(tok(text, add_special_tokens=False)["input_ids"]) + ([eos] if from_model else [])
        ids += seg
        labels += seg if from_model else [IGNORE_INDEX] * len(seg)
    return ids, labels


def run_agent_demo(config: Any, quiet: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    say = (lambda *a: None) if quiet else print
    trainer = RLTrainer(config)
    env = trainer.env
    if not isinstance(env, CalculatorEnv) or trainer.multiturn is None:
        raise ConfigError("the agent demo trains on env.name: calculator with env.agent set; use "
                          "examples/agent_tools.yaml")
    tools = sys.modules[trainer.multiturn.agent.__module__].TOOLS
    turns = ToolTurns(trainer.tokenizer, tools, where="the agent demo")
    say(f"verl agent demo: tiny model ({sum(p.numel() for p in trainer.model.parameters()):,} parameters), "
        f"{len(env)} training problems, {len(env.val_rows())} held out; the agent ({config.env.agent}) calls "
        f"the policy through its OpenAI endpoint, the policy calls a calculator in the "
        f"{config.env.tool_call_format} format")
    demos = env.demonstration_problems(max(min(SFT_EPISODES, len(env.train_problems) - PROBE_PROBLEMS), 1),
                                       config.trainer.seed)  # and PROBE_PROBLEMS others to probe
    direct = np.random.default_rng([config.trainer.seed, 5]).random(len(demos)) < SFT_DIRECT_SHARE
    examples = [conversation_example(trainer, turns, env.problem_row(p), *p, config.env.tool_call_format,
                                     direct=bool(d)) for p, d in zip(demos, direct, strict=True)]
    rest = [p for p in env.train_problems if p not in set(demos)]
    pick = np.random.default_rng([config.trainer.seed, 4]).choice(len(rest), size=min(PROBE_PROBLEMS, len(rest)),
                                                                  replace=False)
    probe = [env.problem_row(rest[int(i)]) for i in pick]
    t0 = time.perf_counter()
    sft = constant_lr_sft(trainer, train_examples=examples)
    sft_steps, probe_acc, history = sft_until(sft, lambda: agent_eval(trainer, probe)["accuracy"],
                                              SFT_TARGET_ACCURACY, config.sft.steps or 300, SFT_CHECK_EVERY,
                                              near=SFT_CHECK_NEAR, ceiling=SFT_CEILING)
    sft_seconds = time.perf_counter() - t0
    val = env.val_rows()
    before = agent_eval(trainer, val)
    say(f"warm start: {sft_steps} SFT steps on {len(examples)} conversations ({int(direct.sum())} without the "
        f"tool; probe accuracy {probe_acc:.0%}), loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} "
        f"({sft_seconds:.0f}s); held-out accuracy {before['accuracy']:.1%}, {before['calls_per_episode']:.2f} calls "
        "per episode; now GRPO on the agent's episodes")
    t0 = time.perf_counter()
    trainer.fit()
    rl_seconds = time.perf_counter() - t0
    after = agent_eval(trainer, val)
    summary = run_summary(
        trainer, start, sft_seconds, rl_seconds, before["accuracy"], after["accuracy"],
        calls_per_episode_after_sft=before["calls_per_episode"], calls_per_episode_after_rl=after["calls_per_episode"],
        sft_steps=sft_steps, sft_probe_accuracy=probe_acc)
    path = trainer.write_summary(summary)
    say(f"held-out accuracy after SFT {before['accuracy']:6.1%}   after GRPO {after['accuracy']:6.1%}   "
        f"({(after['accuracy'] - before['accuracy']) * 100:+.1f} points; calls per episode "
        f"{before['calls_per_episode']:.2f} -> {after['calls_per_episode']:.2f}); wall time "
        f"{summary['wall_seconds']:.0f}s; summary: {path}")
    return summary


__all__ = ["agent_eval", "conversation_example", "run_agent_demo"]
