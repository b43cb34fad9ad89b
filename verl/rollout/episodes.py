"""The `generate` and validation stages for multi-turn environments: episodes instead of single responses.

The batch that comes out looks like a single-turn one: the response part is the whole episode after the
prompt (model text and observations), `response_mask` marks the model's tokens only, and
`response_attention_mask` every real token. The rest of the step (log-probs, KL, advantages, the loss)
runs on it unchanged; the reward sits on the last model-written token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch

from verl.batch import RolloutBatch
from verl.data.datasets import IGNORE_INDEX
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment, check_multiturn_env
from verl.rollout import RolloutEngine, SamplingParams
from verl.rollout.multiturn import MultiTurnOutput, MultiTurnRollout
from verl.rollout.prompts import PromptCodec


@dataclass
class Episodes:
    """Runs a multi-turn environment's episodes on the policy: the parts it needs, nothing more."""

    runner: MultiTurnRollout
    env: MultiTurnEnvironment | Environment  # a multi-turn one; AgentEpisodes': the single-turn one
    prompts: PromptCodec
    policy: torch.nn.Module
    gathered: Callable[[torch.nn.Module], AbstractContextManager[None]]  # sharded weights kept together
    device: torch.device

    @classmethod
    def create(cls, env: MultiTurnEnvironment, engine: RolloutEngine | None, prompts: PromptCodec,
               stop: Sequence[str], *, policy: torch.nn.Module,
               gathered: Callable[[torch.nn.Module], AbstractContextManager[None]],
               device: torch.device) -> Episodes | None:
        """The episode runner of an actor rank (None elsewhere), after checking the environment's limits."""
        check_multiturn_env(env)
        if callable(getattr(env, "bind_tokenizer", None)):  # a chat-template tool environment (ToolEnv)
            env.bind_tokenizer(prompts.tokenizer)
        if engine is None:
            return None
        return cls(MultiTurnRollout(engine, prompts.tokenizer, stop), env, prompts, policy, gathered, device)

    def encode(self, text: str) -> list[int]:
        return self.runner.encode(text)

    def run(self, rows: Sequence[Mapping[str, Any]], n: int, params: SamplingParams,
            generator: torch.Generator | None) -> MultiTurnOutput:
        """n episodes of each row (a row's together), on the policy (gathered when sharded)."""
        prompts, records = self.runner.start(self.env, rows, n)
        tools = {"tools": self.env.tool_schemas} if getattr(self.env, "tool_schemas", None) else {}
        ids, mask = self.prompts.encode([{**dict(r.row), "prompt": p, **tools} for r, p in zip(records, prompts,
                                                                                              strict=True)])
        with self.gathered(self.policy):
            return self.runner.run(self.env, records, ids.to(self.device), mask.to(self.device),
                                   replace(params, n=1), generator=generator)

    def example(self, row: Mapping[str, Any], segments: Sequence[tuple[str, bool]],
                eos: int) -> tuple[list[int], list[int]]:
        """(ids, labels) of a scripted episode for a supervised warm start, tokenised as the rollout sees one.

        The prompt is encoded as the rollout encodes it, each segment on its own (the rollout samples a model
        turn token by token and encodes every observation alone, so a merge across a segment boundary never
        happens there either), and `eos` follows the last model turn. Labels are -100 on the prompt and on the
        environment's segments (`from_model` False): an observation is read, never learned, as in the RL loss.
        """
        ids, mask = self.prompts.encode([row])
        tokens = ids[0][mask[0].bool()].tolist()
        labels = [IGNORE_INDEX] * len(tokens)
        for text, from_model in segments:
            seg = self.encode(text)
            tokens += seg
            labels += seg if from_model else [IGNORE_INDEX] * len(seg)
        return tokens + [eos], labels + [eos]

    def texts(self, out: MultiTurnOutput) -> list[str]:
        """The whole episode after the prompt as text (model turns and observations), for logs and samples."""
        return self.prompts.decode(out.response_ids, out.response_attention_mask)

    def generate(self, batch: RolloutBatch, n: int, params: SamplingParams,
                 generator: torch.Generator | None) -> RolloutBatch:
        """The `generate` stage: `batch.rows` holds each prompt n times in a row."""
        out = self.run(batch.rows[::n], n, params, generator)
        batch.prompt_ids, batch.prompt_mask = out.prompt_ids, out.prompt_mask.long()
        batch.response_ids, batch.response_mask = out.response_ids, out.response_mask.long()
        batch.response_attention_mask = out.response_attention_mask.long()
        batch.finished = out.finished
        batch.rollout_logprobs = out.logprobs
        batch.env_scores = out.rewards
        batch.responses = self.texts(out)
        batch.episodes = list(out.episodes)
        batch.metrics = {**batch.metrics, **out.metrics()}
        return batch

    def evaluate(self, rows: Sequence[Mapping[str, Any]], params: SamplingParams,
                 generator: torch.Generator) -> tuple[torch.Tensor, list[str], dict[str, float]]:
        """(rewards, episode texts, episode metrics) of `params.n` episodes per row, as validation runs them."""
        out = self.run(rows, params.n, params, generator)
        return out.rewards.float().cpu(), self.texts(out), out.metrics()


__all__ = ["Episodes"]
