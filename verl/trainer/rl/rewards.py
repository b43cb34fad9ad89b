"""The RL step's reward stage, in one place: a reward model as one more batched reward function, the
accuracy that dynamic sampling filters groups on, and the reward calls that start while the batch is
still generating.

Reward model (`reward.model_path`): Going through the reward manager means a reward model combines with rule-based
rewards by weight, gets the same error handling and shows up in the metrics as `reward/reward_model/score`.

Overlap (`reward.overlap`): The rollout engine decodes all rows of a batch together, and rows finish at different steps
(an eos early, the length limit last). `HFKVCacheEngine.on_rows_finished` says which rows just finished; `generating`
decodes their text there and hands it to the environment's scoring (`PromptEnv.start_scoring`), whose
per-sample reward calls start on the reward pool at once, so a slow reward (a sandbox, a remote call) runs
while the other rows are still being sampled. `finish`, in `compute_reward`, hands over the whole batch (the
batched and TRL-style functions start there) and waits. The calls get the same arguments as when scoring
after generation, and the result is assembled in a fixed order, so the scores are the same bit for bit.

Single-turn rollouts only: multi-turn episodes are scored by their environment, and an asynchronous rollout
samples on other ranks, so both score after generation, as does an engine without the hook (vLLM).

The pending scoring is kept here, on the trainer, not as a batch field: a split placement moves only the
fields of the batch's layout table between ranks. It is keyed by the batch's row list (and `Scoring.finish`
scores again any response that differs from the one it was given), and `finish` returns None, meaning
"score the plain way", for a batch it was not started for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.algorithms import place_score_on_last_token
from verl.batch import REWARD_TOKENS, RolloutBatch, fields_of, padding, read_by, written_by
from verl.data.chat import reward_text  # what the reward model reads: the same text it was trained on
from verl.distributed.placement import Placement
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment
from verl.models.reward_model import RewardModelScorer
from verl.rewards import RewardResult
from verl.rewards.functions import takes_parameter
from verl.utils.tokenizer_protocol import Tokenizer


class RewardModelFunction:
    """Scores prompt + response with a sequence-classification model, in the model's own chat format."""

    __name__ = "reward_model"

    def __init__(self, scorer: RewardModelScorer, weight: float) -> None:
        self.scorer = scorer
        self.reward_spec = {"weight": weight, "batched": True}

    def __call__(self, prompts: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any],
                 metadatas: Sequence[Mapping[str, Any]]) -> list[float]:
        texts = [reward_text(self.scorer.tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)]
        return self.scorer.score_texts(texts).tolist()


def reward_model_inputs(tokenizer: Tokenizer, prompts: Sequence[Any],
                        responses: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of prompt + response in the reward model's own tokens, right-padded."""
    texts = [reward_text(tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


@dataclass
class RemoteRewardModel:
    """A reward model on ranks of its own (devices.reward apart from the actor's): the actor ranks tokenise
    prompt + response in its tokens, its ranks score them, the actor ranks add `weight` x the scores, as the
    reward function would colocated. `scorer` is None off the reward ranks."""

    tokenizer: Tokenizer
    scorer: RewardModelScorer | None
    weight: float

    def score(self, batch: RolloutBatch | None, placement: Placement) -> RolloutBatch | None:
        """The three stages on their ranks (`placement.run` moves the fields between them)."""
        pads = padding(fields_of(REWARD_TOKENS), reward_pad_token_id=self.tokenizer.pad_token_id)
        batch = placement.align(placement.run("actor", self.inputs, batch), pads)
        batch = placement.run("reward", self.scores, batch, send=read_by("reward"), back=written_by("reward"))
        return placement.run("actor", self.add_scores, batch)

    def inputs(self, batch: RolloutBatch) -> RolloutBatch:
        batch.reward_input_ids, batch.reward_attention_mask = reward_model_inputs(
            self.tokenizer, [row["prompt"] for row in batch.rows], batch.responses)
        return batch

    def scores(self, batch: RolloutBatch) -> RolloutBatch:
        batch.reward_model_scores = self.scorer.score_ids(batch.reward_input_ids, batch.reward_attention_mask)
        return batch

    def add_scores(self, batch: RolloutBatch) -> RolloutBatch:
        scores = batch.reward_model_scores.to(batch.scores.device, torch.float32)
        batch.scores = batch.scores + self.weight * scores
        batch.token_rewards = place_score_on_last_token(batch.scores, batch.response_mask.float())
        batch.metrics["reward/reward_model/score"] = float(scores.mean())
        return batch


def response_id_lists(response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[list[int]]:
    """Each response's sampled token ids (eos included), as the environment's `response_ids` takes them."""
    lengths = response_mask.sum(dim=1).tolist()
    return [row[: int(length)].tolist() for row, length in zip(response_ids.cpu(), lengths, strict=True)]


def score_responses(env: Environment, rows: Sequence[Mapping[str, Any]], responses: Sequence[str],
                    response_ids: torch.Tensor, response_mask: torch.Tensor) -> RewardResult:
    """`env`'s scores of the responses, after generation; an environment that takes `response_ids` gets each
    response's sampled token ids too (TRL's `completion_ids`), eos included."""
    if not takes_parameter(env.compute_reward, "response_ids"):
        return env.compute_reward(rows, responses)
    return env.compute_reward(rows, responses, response_ids=response_id_lists(response_ids, response_mask))


class RewardOverlap:
    """Starts a batch's reward calls as its rows finish generating (see the module docstring)."""

    def __init__(self, enabled: bool, env: Environment | MultiTurnEnvironment, engine: Any,
                 decode: Callable[[torch.Tensor, torch.Tensor], list[str]]) -> None:
        self.enabled = (enabled and callable(getattr(env, "start_scoring", None))
                        and hasattr(engine, "on_rows_finished"))
        self.env, self.engine, self.decode = env, engine, decode
        self._pending: tuple[list[Any], Any] | None = None  # (the batch's rows, its Scoring)
        self._texts: dict[int, str] = {}  # the last generation's responses, decoded as their rows finished

    @contextlib.contextmanager
    def generating(self, batch: RolloutBatch) -> Iterator[None]:
        """Around the engine's `generate` of `batch`: each finished row's response goes to the scoring."""
        self._pending, self._texts = None, {}
        scoring = self.env.start_scoring(batch.rows) if self.enabled else None
        if scoring is None:
            yield
            return

        def finished(rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
            steps = torch.arange(tokens.shape[1], device=tokens.device)
            mask = steps < lengths[rows].unsqueeze(1)
            texts = self.decode(tokens[rows].cpu(), mask.cpu())
            self._texts.update(zip(rows.tolist(), texts, strict=True))
            scoring.add(rows.tolist(), texts)

        before, self.engine.on_rows_finished = self.engine.on_rows_finished, finished
        try:
            yield
        finally:
            self.engine.on_rows_finished = before
        self._pending = (batch.rows, scoring)

    def responses(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        """The text of the generation that just ended: as decoded for the reward calls when every row was (a
        response is decoded once), else decoded now."""
        texts, self._texts = self._texts, {}
        if len(texts) == len(response_ids):
            return [texts[i] for i in range(len(texts))]
        return self.decode(response_ids, response_mask)

    def finish(self, batch: RolloutBatch) -> RewardResult | None:
        """The result of the scoring started for `batch`, once every call is done; None when none was."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not batch.rows or len(pending[1]) != len(batch.rows):
            return None
        return pending[1].finish(batch.responses, response_id_lists(batch.response_ids, batch.response_mask))


def accuracy_of(result: Any, scores: torch.Tensor) -> torch.Tensor:
    """[N] what the groups are filtered on: the reward's `acc` extra (`RewardResult.accuracy`) where it gave
    one, else the score before shaping (call it before the overlong penalty is added)."""
    base = scores.detach().clone()
    acc = getattr(result, "accuracy", None)  # an environment's own result type may not have it
    if acc is None:
        return base
    acc = acc.to(base)
    return torch.where(torch.isnan(acc), base, acc)


def reward_parts(result: Any) -> list[dict[str, float]]:
    """Per sample, each reward function's unweighted score where it applies (what `verl view` shows beside the
    total); [] when the environment's result has no parts."""
    per_function, applied = getattr(result, "per_function", None) or {}, getattr(result, "applied", None) or {}
    if not per_function:
        return []
    names = list(per_function)
    scores = {k: per_function[k].tolist() for k in names}
    used = {k: applied[k].tolist() if k in applied else [True] * len(scores[k]) for k in names}
    return [{k: scores[k][i] for k in names if used[k][i]} for i in range(len(result.scores))]


__all__ = ["accuracy_of", "RewardOverlap", "response_id_lists", "reward_parts", "score_responses"]
