"""What the policy did, a few rollouts per step: `rollouts.jsonl` and `tokens.jsonl` for `verl view`.

`logging.rollout_samples` rollouts of each step (spread over the batch, so over its prompts; numbered by
`sample` within the step, the same number in both files) go to rollouts.jsonl: prompt, response, the reward
and each reward function's part, the advantage and, for a multi-turn or agent episode, its transcript (model
turns, which are trained, and observations, which are not).
The first `logging.token_samples` of them also go to tokens.jsonl with one value per response token: the
sampler's log-prob, the old policy's, the reference's, the advantage and the critic's value from the batch;
and what the update's loss saw (no forward of its own: `update.policy_loss` hands over the micro-batches that
hold traced rows): the log-prob and entropy of the row's first pass, and of its last pass the ratio to the old
policy, the rollout-correction weight and `clipped`, the tokens where the ratio lies beyond the clip range on
their advantage's side (PPO-style losses: the clipped term won, no gradient). `logprob_gap` is the trainer's
log-prob minus the sampler's on the same weights (the old policy's pass, else a first pass before any optimizer
step): what rollout correction and the drift guard look at. A row the update left out (advantage 0 with
actor.skip_zero_advantage) or split over sequence-parallel ranks has only the batch's values. Rank 0's rows
are written.
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
    """Picks a step's traced rows, records what the update's loss saw of them, and builds the rows of
    rollouts.jsonl and tokens.jsonl (`rows`, which the training loop writes and clears)."""

    def __init__(self, config: RunConfig, tokenizer: Tokenizer) -> None:
        log, actor = config.logging, config.actor
        self.rollout_samples, self.token_samples = log.rollout_samples, min(log.token_samples, log.rollout_samples)
        self.tokenizer = tokenizer
        options = {**get_policy_loss(actor.policy_loss).defaults(), **actor.loss_kwargs()}
        self.clip = ((options.get("clip_low"), options.get("clip_high"))
                     if actor.policy_loss in TOKEN_CLIP_LOSSES else None)
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self._picked: list[int] = []
        self._first: dict[int, dict[str, torch.Tensor]] = {}  # traced row -> its first pass through the loss
        self._last: dict[int, dict[str, torch.Tensor]] = {}  # ... and its last
        self._steps = 0  # optimizer steps of this update so far
        self._texts: dict[int, str] = {}  # token id -> its text (`_token_texts`)

    @classmethod
    def wanted(cls, config: RunConfig) -> bool:
        return config.logging.rollout_samples > 0

    def before_update(self, batch: RolloutBatch) -> RolloutBatch:
        """Pick the rows, and mark the token-traced ones for the update's loss (an actor stage)."""
        self._picked = picked_rows(self.rollout_samples, len(batch))
        self._first, self._last, self._steps = {}, {}, 0
        if self.token_samples:
            ids = torch.full((len(batch),), -1, dtype=torch.long)
            ids[self._picked[: self.token_samples]] = torch.arange(len(self._picked[: self.token_samples]))
            batch.trace_ids = ids
        return batch

    def stepped(self) -> None:
        """The update is about to take an optimizer step (a later pass runs on other weights than sampled)."""
        self._steps += 1

    def observe(self, mb: RolloutBatch, values: Mapping[str, torch.Tensor]) -> None:
        """A micro-batch's per-token values as the loss used them (`update.policy_loss`'s `on_traced`)."""
        for r in (mb.trace_ids >= 0).nonzero().flatten().tolist():
            k, length = int(mb.trace_ids[r]), int(mb.response_attention[r].sum())
            seen = {name: v[r, :length].float().cpu() for name, v in values.items()}
            seen["advantage"] = mb.advantages[r, :length].float().cpu()  # after entropy_top_fraction's mask
            seen["stepped"] = torch.tensor(self._steps)
            self._first.setdefault(k, seen)
            self._last[k] = seen

    def after_update(self, batch: RolloutBatch, step: int) -> None:
        """The rows of `step` into `self.rows` (after the update, which measured the traced tokens)."""
        if not self._picked:
            return
        rollouts = [self._rollout_row(batch, i, step) | {"sample": k} for k, i in enumerate(self._picked)]
        tokens = [self._token_row(batch, i, k, step) | {"sample": k}
                  for k, i in enumerate(self._picked[: self.token_samples])]
        self.rows = {"rollouts.jsonl": rollouts, "tokens.jsonl": tokens}
        self._picked, self._first, self._last = [], {}, {}
        batch.trace_ids = None

    # ------------------------------------------------------------------ rows
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

    def _token_row(self, batch: RolloutBatch, i: int, k: int, step: int) -> dict[str, Any]:
        length = int(batch.response_attention[i].sum())
        ids = batch.response_ids[i, :length].tolist()
        mask = batch.response_mask[i, :length].float()
        values: dict[str, torch.Tensor] = {}
        fields = {"sampler_logprob": batch.rollout_logprobs, "old_logprob": batch.old_logprobs,
                  "ref_logprob": batch.ref_logprobs, "advantage": batch.advantages, "value": batch.values}
        for name, field in fields.items():
            if field is not None:
                values[name] = field[i, :length].float().cpu()
        first, last = self._first.get(k), self._last.get(k)
        clipped = None
        if first is not None and last is not None:  # a row the update skipped (advantage 0) has none of these
            values |= {"logprob": first["logprob"], "entropy": first["entropy"]}
            ratio = torch.exp(last["logprob"] - last["old"])
            values["ratio"] = ratio
            if "rollout_corr_weight" in last:
                values["rollout_corr_weight"] = last["rollout_corr_weight"]
            if self.clip is not None:
                low, high = self.clip
                adv = last["advantage"]
                cut = (adv > 0) & (ratio > 1 + high)
                if low is not None:
                    cut |= (adv < 0) & (ratio < 1 - low)
                clipped = (cut & mask.bool()).int().tolist()
        sampler = values.get("sampler_logprob")
        if sampler is not None and "old_logprob" in values and not torch.equal(values["old_logprob"], sampler):
            values["logprob_gap"] = values["old_logprob"] - sampler  # the old policy's pass: the sampling weights
        elif sampler is not None and first is not None and int(first["stepped"]) == 0:
            values["logprob_gap"] = first["logprob"] - sampler  # the loss's first pass, before any step
        off = (mask == 0).tolist()
        row = {"step": step, "group": str(int(batch.group_ids[i])), "prompt": prompt_text(batch.rows[i]),
               "tokens": self._token_texts(ids),
               "values": {name: [None if o else compact(float(x)) for x, o in zip(v.tolist(), off, strict=True)]
                          for name, v in values.items()},
               "masked": [int(o) for o in off]}
        if clipped is not None:
            row["clipped"] = clipped
        return row

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text, decoded once per token id for the run (a decode call per token costs more than
        the rest of a traced row)."""
        missing = sorted(set(ids) - self._texts.keys())
        if missing:
            self._texts.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing],
                                                                       skip_special_tokens=False), strict=True))
        return [self._texts[t] for t in ids]


__all__ = ["RolloutTrace", "compact", "episode_trace", "picked_rows", "prompt_text"]
