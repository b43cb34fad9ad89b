"""The `generate` and validation stages for multi-turn environments: episodes instead of single responses.

The batch that comes out looks like a single-turn one: the response part is the whole episode after the
prompt (model text and observations), `response_mask` marks the model's tokens only, and
`response_attention_mask` every real token. The rest of the step (log-probs, KL, advantages, the loss)
runs on it unchanged; the reward sits on the last model-written token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl.data.datasets import IGNORE_INDEX
from verl.env.multiturn import check_multiturn_env
from verl.rollout import SamplingParams
from verl.rollout.multiturn import MultiTurnOutput, MultiTurnRollout
from verl.trainer.batch import RolloutBatch


def build_multiturn(trainer: Any) -> MultiTurnRollout | None:
    """The episode runner of an actor rank, after checking the environment's episode limits."""
    check_multiturn_env(trainer.env)
    if trainer.engine is None:
        return None
    return MultiTurnRollout(trainer.engine, trainer.tokenizer, trainer.config.rollout.stop)


def run_episodes(trainer: Any, rows: Sequence[Mapping[str, Any]], n: int, params: SamplingParams,
                 generator: torch.Generator | None) -> MultiTurnOutput:
    """n episodes of each row, on the trainer's model (gathered when sharded)."""
    runner: MultiTurnRollout = trainer.multiturn
    prompts, records = runner.start(trainer.env, rows, n)
    ids, mask = trainer.encode_prompts([{**dict(r.row), "prompt": p} for r, p in zip(records, prompts, strict=True)])
    one = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                         max_new_tokens=params.max_new_tokens, n=1, eos_token_ids=params.eos_token_ids,
                         pad_token_id=params.pad_token_id)
    with trainer.gathered(trainer.model):
        return runner.run(trainer.env, records, ids.to(trainer.device), mask.to(trainer.device), one,
                          generator=generator)


def episode_example(trainer: Any, row: Mapping[str, Any],
                    segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of a scripted episode for a supervised warm start, tokenised as the rollout sees one.

    The prompt is encoded as the rollout encodes it, each segment on its own (the rollout samples a model
    turn token by token and encodes every observation alone, so a merge across a segment boundary never
    happens there either), and eos follows the last model turn. Labels are -100 on the prompt and on the
    environment's segments (`from_model` False): an observation is read, never learned, as in the RL loss.
    """
    ids, mask = trainer.encode_prompts([row])
    tokens = ids[0][mask[0].bool()].tolist()
    labels = [IGNORE_INDEX] * len(tokens)
    for text, from_model in segments:
        seg = trainer.multiturn.encode(text)
        tokens += seg
        labels += seg if from_model else [IGNORE_INDEX] * len(seg)
    eos = trainer.sampling.eos_token_ids[0]
    return tokens + [eos], labels + [eos]


def decode_episodes(trainer: Any, out: MultiTurnOutput) -> list[str]:
    """The whole episode after the prompt as text (model turns and observations), for logs and samples."""
    return trainer.decode_responses(out.response_ids, out.response_attention_mask)


def generate_episodes(trainer: Any, batch: RolloutBatch) -> RolloutBatch:
    n = trainer.config.rollout.n
    out = run_episodes(trainer, batch.rows[::n], n, trainer.sampling, trainer.generator)
    batch.prompt_ids, batch.prompt_mask = out.prompt_ids, out.prompt_mask.long()
    batch.response_ids, batch.response_mask = out.response_ids, out.response_mask.long()
    batch.response_attention_mask = out.response_attention_mask.long()
    batch.finished = out.finished
    batch.rollout_logprobs = out.logprobs
    batch.env_scores = out.rewards
    batch.responses = decode_episodes(trainer, out)
    batch.metrics = {**batch.metrics, **out.metrics()}
    return batch


def evaluate_episodes(trainer: Any, rows: Sequence[Mapping[str, Any]], params: SamplingParams,
                      generator: torch.Generator) -> tuple[torch.Tensor, list[str], dict[str, float]]:
    """(rewards, episode texts, episode metrics) of `params.n` episodes per row (a row's together), as
    validation runs them."""
    out = run_episodes(trainer, rows, params.n, params, generator)
    return out.rewards.float().cpu(), decode_episodes(trainer, out), out.metrics()


__all__ = ["build_multiturn", "decode_episodes", "episode_example", "evaluate_episodes", "generate_episodes", "run_episodes"]
