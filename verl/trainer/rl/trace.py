"""What the policy did, a few rollouts per step: `rollouts.jsonl` and `tokens.jsonl` for `verl view`.

`logging.rollout_samples` rollouts of each step (spread over the batch, so over its prompts) go to
rollouts.jsonl: prompt, response, the reward and each reward function's part, the advantage and, for a
multi-turn or agent episode, its transcript (model turns, which are trained, and observations, which are not).
The first `logging.token_samples` of them also go to tokens.jsonl with one value per response token: the
trainer's log-prob and entropy before the update, the sampler's log-prob and the gap between the two (what
rollout correction and the drift guard look at), the advantage, the reference's log-prob, the critic's value,
the rollout-correction weight, and after the update the ratio to the old policy, with `clipped` marking tokens
the PPO clip range cuts on their advantage's side.

The values come from two forwards of those few rows without gradient, one before and one after the update, on
every actor rank (its own rows, so the sharded forwards stay in step); rank 0's rows are written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verl.algorithms.policy_losses import get_policy_loss
from verl.batch import RolloutBatch
from verl.config.schema import RunConfig
from verl.utils.tokenizer_protocol import Tokenizer

# Policy losses that clip each token's ratio to [1 - clip_low, 1 + clip_high]: where `clipped` means something.
TOKEN_CLIP_LOSSES = frozenset({"ppo", "cispo"})
SIGNIFICANT_DIGITS = 5  # per-token values are rounded to this many significant digits (a compact file)


def compact(value: float) -> float | None:
    """A float for JSON: rounded, None where not finite (JSON has no NaN)."""
    if not math.isfinite(value):
        return None
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}")


def picked_rows(count: int, size: int) -> list[int]:
    """`count` rows spread evenly over a batch of `size` (the first of every size/count), so over its prompts."""
    count = min(count, size)
    return sorted({i * size // count for i in range(count)}) if count else []


def prompt_text(row: Mapping[str, Any]) -> str:
    """The row's prompt as text: a chat's messages one per line."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


def episode_trace(record: Any, ids: Sequence[int], trained: Sequence[int], decode: Callable[[list[int]], str],
                  ) -> dict[str, Any]:
    """A multi-turn or agent episode (`verl.rollout.multiturn.EpisodeRecord`) as turns of consecutive tokens
    the model wrote (trained) or read (observations: tool results, the environment's answers); the episode's
    reward goes with its last model turn."""
    turns: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trained[end] != trained[start]:
            model = bool(trained[start])
            turns.append({"role": "assistant" if model else "tool", "text": decode(list(ids[start:end])),
                          "trained": model, "reward": None, "error": None})
            start = end
    info = getattr(record, "info", {}) or {}
    failed, truncated = bool(info.get("agent_failed")), getattr(record, "truncated", "")
    status = "failed" if failed else "timeout" if truncated == "timeout" else "truncated" if truncated else "ok"
    error = None
    if failed and record.transcript:
        error = str(record.transcript[0][1])
    elif truncated:
        error = f"truncated: {truncated}"
    model_turns = [t for t in turns if t["trained"]]
    if model_turns:
        model_turns[-1]["reward"] = float(record.reward)
    observations = [t for t in turns if not t["trained"]]
    for turn, failed_call in zip(observations, getattr(record, "observation_errors", []), strict=False):
        turn["error"] = "tool error" if failed_call else None
    if error is not None and turns:
        turns[-1]["error"] = error
    return {"status": status, "error": error, "turns": turns, "tool_calls": int(getattr(record, "tool_calls", 0)),
            "tool_errors": int(getattr(record, "tool_errors", 0))}


class RolloutTrace:
    """Picks a step's traced rows, measures their tokens before and after the update, and builds the rows of
    rollouts.jsonl and tokens.jsonl (`rows`, which the training loop writes and clears)."""

    def __init__(self, config: RunConfig, tokenizer: Tokenizer,
                 forward: Callable[[RolloutBatch], tuple[torch.Tensor, torch.Tensor]],
                 correction: Callable[[torch.Tensor, RolloutBatch], Any]) -> None:
        """`forward(rows)`: (log-probs, entropy) [m, R] of the rows' response tokens under the current policy,
        without gradient; `correction(old_logprobs, rows)`: the rollout correction's `Correction` or None."""
        log = config.logging
        self.rollout_samples, self.token_samples = log.rollout_samples, min(log.token_samples, log.rollout_samples)
        self.tokenizer, self.forward, self.correction = tokenizer, forward, correction
        actor = config.actor
        options = {**get_policy_loss(actor.policy_loss).defaults(), **actor.loss_kwargs()}
        self.clip = ((options.get("clip_low"), options.get("clip_high"))
                     if actor.policy_loss in TOKEN_CLIP_LOSSES else None)
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self._picked: list[int] = []
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def wanted(cls, config: RunConfig) -> bool:
        return config.logging.rollout_samples > 0

    def before_update(self, batch: RolloutBatch) -> RolloutBatch:
        """Pick the rows and measure the traced ones under the weights that sampled them (an actor stage)."""
        self._picked = picked_rows(self.rollout_samples, len(batch))
        self._before = None
        if self.token_samples and batch.response_ids is not None:
            self._before = self.forward(self._sub(batch))
        return batch

    def after_update(self, batch: RolloutBatch, step: int) -> RolloutBatch:
        """The rows of `step` (after its update: the ratio needs the new weights), into `self.rows`."""
        if not self._picked:
            return batch
        after = self.forward(self._sub(batch))[0] if self._before is not None else None
        rollouts, tokens = [], []
        for j, i in enumerate(self._picked):
            rollouts.append(self._rollout_row(batch, i, step))
            if self._before is not None and j < self.token_samples:
                tokens.append(self._token_row(batch, i, j, step, after))
        self.rows = {"rollouts.jsonl": rollouts, "tokens.jsonl": tokens}
        self._picked, self._before = [], None
        return batch

    # ------------------------------------------------------------------ rows
    def _sub(self, batch: RolloutBatch) -> RolloutBatch:
        return batch.select(torch.tensor(self._picked[: self.token_samples], dtype=torch.long))

    def _rollout_row(self, batch: RolloutBatch, i: int, step: int) -> dict[str, Any]:
        row = batch.rows[i]
        mask = batch.response_mask[i].float()
        advantage = (float((batch.advantages[i].float() * mask).sum() / mask.sum().clamp(min=1))
                     if batch.advantages is not None else None)
        out = {"step": step, "group": str(int(batch.group_ids[i])), "prompt": prompt_text(row),
               "response": batch.responses[i] if batch.responses else "", "data_source": row.get("data_source"),
               "ground_truth": row.get("ground_truth"),
               "reward": compact(float(batch.scores[i])) if batch.scores is not None else None,
               "rewards": {k: compact(v) for k, v in (batch.reward_parts[i] if batch.reward_parts else {}).items()},
               "advantage": None if advantage is None else compact(advantage), "response_length": int(mask.sum()),
               "episode": None}
        if batch.episodes:
            length = int(batch.response_attention[i].sum())
            out["episode"] = episode_trace(batch.episodes[i], batch.response_ids[i, :length].tolist(),
                                           batch.response_mask[i, :length].tolist(), self._decode)
        return out

    def _token_row(self, batch: RolloutBatch, i: int, j: int, step: int,
                   after: torch.Tensor | None) -> dict[str, Any]:
        length = int(batch.response_attention[i].sum())
        ids = batch.response_ids[i, :length].tolist()
        mask = batch.response_mask[i, :length].float()
        logprob, entropy = (t[j, :length].float().cpu() for t in self._before)
        values: dict[str, torch.Tensor] = {"logprob": logprob, "entropy": entropy}
        fields = {"sampler_logprob": batch.rollout_logprobs, "old_logprob": batch.old_logprobs,
                  "ref_logprob": batch.ref_logprobs, "advantage": batch.advantages, "value": batch.values}
        for name, field in fields.items():
            if field is not None:
                values[name] = field[i, :length].float().cpu()
        if batch.rollout_logprobs is not None:
            values["logprob_gap"] = logprob - values["sampler_logprob"]
        old = values.get("old_logprob", logprob)
        sub = batch.select(torch.tensor([i], dtype=torch.long))
        correction = self.correction(old.unsqueeze(0).to(sub.response_mask.device), sub) \
            if batch.rollout_logprobs is not None else None
        if correction is not None:
            values["rollout_corr_weight"] = correction.weights[0, :length].float().cpu()
        clipped = None
        if after is not None:
            ratio = torch.exp(after[j, :length].float().cpu() - old)
            values["ratio"] = ratio
            if self.clip is not None and "advantage" in values:
                low, high = self.clip
                adv = values["advantage"]
                cut = (adv > 0) & (ratio > 1 + high)
                if low is not None:
                    cut |= (adv < 0) & (ratio < 1 - low)
                clipped = (cut & mask.bool()).int().tolist()
        off = (mask == 0).tolist()
        row = {"step": step, "group": str(int(batch.group_ids[i])), "prompt": prompt_text(batch.rows[i]),
               "tokens": [self._decode([t]) for t in ids],
               "values": {k: [None if o else compact(float(x)) for x, o in zip(v.tolist(), off, strict=True)]
                          for k, v in values.items()},
               "masked": [int(o) for o in off]}
        if clipped is not None:
            row["clipped"] = clipped
        return row

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


__all__ = ["RolloutTrace", "compact", "episode_trace", "picked_rows", "prompt_text"]
