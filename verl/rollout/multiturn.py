"""Multi-turn rollout: the model writes a turn, the environment answers, the answer's tokens are prefilled
on the same KV cache, and the model continues; batched over episodes.

The cache has one column per step for the whole batch. A row whose turn ended (stop string or eos)
while others still write leaves the decode batch: its cache rows are set aside and rejoin the batch
when the turn is over, with a *hole* for every step it sat out: a column whose attention mask is 0, so
no later token attends to it and its position id is not counted. Its last token is fed with the
observation that answers it. Observations of different lengths are fed as one block, right-aligned
behind holes, so the last column of the block is every row's latest real token.
Real tokens therefore see exactly the keys and positions they would see in a fresh forward over the
compact episode (prompt, model text, observations, model text, ...), which is what the trainer runs:
its log-probs equal the sampler's up to float rounding (tested). Episodes that end leave the batch and
the cache, so they stop costing compute.

The result is laid out like a single-turn rollout: `response_ids` is everything after the prompt, right-
padded; `response_mask` is 1 on model-written tokens only (the loss, KL and entropy run on it);
`response_attention_mask` is 1 on every real token (model and observation), for the forward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl.env.episode import Done, EpisodeEnv, Observation, check_reward, env_name, truncated_reward
from verl.errors import ConfigError, EnvError, VerlError
from verl.rollout.base import SamplingParams
from verl.rollout.hf_engine import EndCheck, HFKVCacheEngine
from verl.utils.tokenizer_protocol import Tokenizer


@dataclass
class EpisodeRecord:
    """One episode while it runs, and after."""

    row: Mapping[str, Any]
    row_index: int  # the row's place in the batch the episodes were started from
    state: Any
    tokens: list[int] = field(default_factory=list)  # after the prompt: model and observation tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 = written by the model
    logprobs: list[float] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)  # the model's current turn
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    finished: bool = False  # ended by Done (not truncated)
    truncated: str = ""  # why it was truncated: "max_turns", "budget", "max_new_tokens"
    transcript: list[tuple[str, str]] = field(default_factory=list)  # ("model" | "env", text)
    observation_errors: list[bool] = field(default_factory=list)  # per observation read: a failed tool call
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class MultiTurnOutput:
    prompt_ids: torch.Tensor  # [E, P] left-padded
    prompt_mask: torch.Tensor  # [E, P]
    response_ids: torch.Tensor  # [E, R] model + observation tokens, right-padded
    response_mask: torch.Tensor  # [E, R] 1 on model-written tokens only
    response_attention_mask: torch.Tensor  # [E, R] 1 on every real token
    logprobs: torch.Tensor  # [E, R] the sampler's log-probs on model tokens, 0 elsewhere
    finished: torch.Tensor  # [E] ended by Done
    rewards: torch.Tensor  # [E] float32
    episodes: list[EpisodeRecord]

    def metrics(self) -> dict[str, float]:
        """Per-episode means over this batch of episodes."""
        eps = self.episodes
        count = max(len(eps), 1)
        out = {
            "episode/turns_mean": sum(e.turns for e in eps) / count,
            "episode/tool_calls_mean": sum(e.tool_calls for e in eps) / count,
            "episode/tool_errors_mean": sum(e.tool_errors for e in eps) / count,
            "episode/truncated_ratio": sum(bool(e.truncated) for e in eps) / count,
            "episode/observation_tokens_mean": sum(len(e.tokens) - sum(e.loss_mask) for e in eps) / count,
        }
        for reason in ("max_turns", "budget", "max_new_tokens"):
            out[f"episode/truncated_{reason}_ratio"] = sum(e.truncated == reason for e in eps) / count
        # Numbers the environment reported in Done(info=...), averaged over all episodes (absent = 0).
        keys = sorted({k for e in eps for k, v in e.info.items()
                       if isinstance(v, (bool, int, float)) and math.isfinite(float(v))})
        for k in keys:
            out[f"episode/{k}"] = sum(float(e.info.get(k, 0.0)) for e in eps) / count
        return out


def _row_where(record: EpisodeRecord) -> str:
    row = record.row
    where = f"row {record.row_index} of the batch"
    if row.get("file") is not None and row.get("line") is not None:
        where += f" ({row['file']}:{row['line']})"
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        where += f", prompt {prompt[:60]!r}"
    return where


def _stop_hit(tokenizer: Tokenizer, turn_tail: list[int], stop: Sequence[str]) -> bool:
    """Whether the turn's decoded text now contains a stop string. Tokenizers merge characters across token
    boundaries, so the check runs on the decoded suffix of the turn (a stop string can only have appeared
    with the latest token: the earlier suffixes were checked already)."""
    if not stop:
        return False
    text = tokenizer.decode(turn_tail, skip_special_tokens=False)
    return any(s in text for s in stop)


class MultiTurnRollout:
    """Runs batches of episodes of a multi-turn environment on an `HFKVCacheEngine`'s model."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        if not isinstance(engine, HFKVCacheEngine):
            raise ConfigError(f"multi-turn episodes run on the 'hf' rollout engine (observations are prefilled "
                              f"on its KV cache); got {type(engine).__name__}. Set rollout.engine=hf.")
        bad = [s for s in stop if not isinstance(s, str) or not s]
        if bad:
            raise ConfigError(f"rollout.stop must be a list of non-empty strings, got {list(stop)!r}")
        self.engine = engine
        self.model = engine.model
        self.tokenizer = tokenizer
        self.stop = list(stop)
        # Tokens decoded for the stop check: enough to hold the longest stop string even when every token
        # is a single byte, plus a few for tokens merged across its ends.
        self.window = max((len(s.encode()) for s in self.stop), default=1) + 4

    # -- the environment, with errors that name it, the episode's row and the turn ----------------
    def _call_env(self, env: EpisodeEnv, record: EpisodeRecord, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except VerlError:
            raise
        except Exception as e:
            turn = "the start" if what == "start" else f"turn {record.turns}"
            raise EnvError(
                f"environment {env_name(env)} raised {type(e).__name__}: {e} in {what}() at {turn} of the "
                f"episode of {_row_where(record)}"
                + (f"; the model had written {record.transcript[-1][1][-200:]!r}" if record.transcript else "")
                + ". Fix the environment: a malformed tool call or model answer is the environment's to answer "
                "with an error Observation or Done(reward=...), not to raise on.") from e

    def start(self, env: EpisodeEnv, rows: Sequence[Mapping[str, Any]],
              n: int) -> tuple[list[Any], list[EpisodeRecord]]:
        """env.start for n episodes of every row: (first messages per episode, records)."""
        prompts, records = [], []
        for i, row in enumerate(rows):
            for _ in range(n):
                record = EpisodeRecord(row=row, row_index=i, state=None)
                result = self._call_env(env, record, "start", lambda row=row: env.start(row))
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise EnvError(f"environment {env_name(env)}.start() returned {type(result).__name__} for "
                                   f"{_row_where(record)}; it must return (first messages, episode state).")
                prompts.append(result[0])
                record.state = result[1]
                records.append(record)
        return prompts, records

    def encode(self, text: str) -> list[int]:
        """An observation's tokens, encoded on their own (no special tokens) as they are appended."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- the rollout ------------------------------------------------------------------------------
    def run(self, env: EpisodeEnv, records: list[EpisodeRecord], input_ids: torch.Tensor, attention_mask: torch.Tensor,
            params: SamplingParams, generator: torch.Generator | None = None) -> MultiTurnOutput:
        """Run the episodes of `records` from their encoded first messages ([E, P], left-padded)."""
        if params.n != 1:
            raise ConfigError("MultiTurnRollout.run takes one row per episode (SamplingParams.n=1); repeat the "
                              "prompts for n episodes per row with start(env, rows, n).")
        if len(records) != input_ids.shape[0]:
            raise ConfigError(f"{len(records)} episodes but {input_ids.shape[0]} encoded prompts; pass one "
                              "prompt row per episode.")
        self.engine.check_inputs(input_ids, attention_mask, params)
        budget, max_turns = int(env.max_episode_tokens), int(env.max_turns)
        limit = getattr(self.engine.text_config, "max_position_embeddings", None)
        if isinstance(limit, int) and input_ids.shape[1] + budget > limit:
            raise ConfigError(f"prompt length {input_ids.shape[1]} + the episode budget {budget} "
                              f"({env_name(env)}.max_episode_tokens) = {input_ids.shape[1] + budget} exceeds the "
                              f"model's max_position_embeddings {limit}; lower max_episode_tokens (env.kwargs) or "
                              "the maximum prompt length.")
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                self._run(env, records, input_ids, attention_mask, params, generator, budget, max_turns)
        finally:
            model.train(was_training)
        return self._output(records, input_ids, attention_mask, params)

    def _run(self, env: EpisodeEnv, records: list[EpisodeRecord], input_ids: torch.Tensor, attention_mask: torch.Tensor,
             params: SamplingParams, generator: torch.Generator | None, budget: int, max_turns: int) -> None:
        engine = self.engine
        state = engine.prefill(input_ids, attention_mask, input_ids.shape[1] + budget + 16)
        device, pad = state.logits.device, params.resolved_pad_token_id
        active = list(range(len(records)))  # the record of each row of the batch
        for turn in range(1, max_turns + 1):
            why: dict[int, str] = {}  # row -> "stop" | "budget", for turns that ended for that
            end = self._turn_end([len(records[i].tokens) for i in active], budget, why)
            decoded = engine.decode(state, params, params.max_new_tokens, generator, keep=True, end=end)
            # The environment answers every episode whose turn ended by a stop string or eos.
            keep: list[int] = []  # the episodes that go on
            kept_rows: list[int] = []  # their rows in the batch
            blocks: list[list[int]] = []  # per kept episode: the turn's last token, then the observation
            lengths = decoded.lengths.tolist()
            for r, (i, toks, lps, eos) in enumerate(zip(active, decoded.tokens.tolist(), decoded.logprobs.tolist(),
                                                        decoded.eos.tolist(), strict=True)):
                rec = records[i]
                rec.turns = turn
                rec.turn_tokens = toks[: lengths[r]]
                rec.tokens += rec.turn_tokens
                rec.loss_mask += [1] * lengths[r]
                rec.logprobs += lps[: lengths[r]]
                ended = "eos" if eos else why.get(r, "max_new_tokens")
                text = self.tokenizer.decode(rec.turn_tokens, skip_special_tokens=True)
                rec.transcript.append(("model", text))
                if ended in ("budget", "max_new_tokens"):
                    self._truncate(env, rec, ended)
                    continue
                answer = self._call_env(env, rec, "step", lambda rec=rec, text=text: env.step(rec.state, text))
                if not isinstance(answer, (Observation, Done)):
                    raise EnvError(
                        f"environment {env_name(env)}.step() returned {type(answer).__name__} at turn {turn} of "
                        f"the episode of {_row_where(rec)}; it must return verl.env.Observation(text) to "
                        "continue or verl.env.Done(reward) to end the episode.")
                rec.tool_calls += int(bool(answer.tool_call))
                rec.tool_errors += int(bool(answer.tool_error))
                if isinstance(answer, Done):
                    rec.reward = check_reward(env, answer.reward, f"at turn {turn} of the episode of {_row_where(rec)}")
                    rec.finished = True
                    rec.info = dict(answer.info)
                    continue
                if not isinstance(answer.text, str):
                    raise EnvError(f"environment {env_name(env)}.step() returned Observation(text="
                                   f"{type(answer.text).__name__}) at turn {turn} of the episode of "
                                   f"{_row_where(rec)}; the observation must be a string.")
                rec.transcript.append(("env", answer.text))
                rec.observation_errors.append(bool(answer.tool_error))
                obs = self.encode(answer.text)
                if turn == max_turns:
                    self._truncate(env, rec, "max_turns")
                    continue
                if len(rec.tokens) + len(obs) >= budget:  # no room left for the model's next token
                    self._truncate(env, rec, "budget")
                    continue
                rec.tokens += obs
                rec.loss_mask += [0] * len(obs)
                rec.logprobs += [0.0] * len(obs)
                keep.append(i)
                kept_rows.append(r)
                blocks.append(rec.turn_tokens[-1:] + obs)
            if not keep:
                return
            # Episodes that ended leave the batch and the cache.
            state.select(torch.tensor(kept_rows, dtype=torch.long, device=device))
            active = keep
            # Each turn's last token and the observation after it, right-aligned behind holes: the block's
            # last column is every row's latest real token.
            width = max(len(b) for b in blocks)
            block = torch.full((len(keep), width), pad, dtype=torch.long, device=device)
            block_mask = torch.zeros((len(keep), width), dtype=torch.bool, device=device)
            for r, b in enumerate(blocks):
                block[r, width - len(b):] = torch.tensor(b, dtype=torch.long, device=device)
                block_mask[r, width - len(b):] = True
            engine.extend(state, block, block_mask)

    def _turn_end(self, written: list[int], budget: int, why: dict[int, str]) -> EndCheck:
        """Whether rows' turns end at a decode step by a stop string or the episode budget (`written`:
        each row's tokens before this turn); the reason goes to `why`. The engine asks with host copies of the
        tokens, a window of steps at a time (`eos_check_every`), so deciding costs the device no sync; stop
        strings are matched on decoded text (tokenizers merge characters across tokens), which only the host
        does."""

        def end(rows: torch.Tensor, step: int, tokens: torch.Tensor) -> torch.Tensor:
            tails = tokens[rows, max(0, step + 1 - self.window): step + 1].tolist()
            out = []
            for r, tail in zip(rows.tolist(), tails, strict=True):
                reason = ("stop" if _stop_hit(self.tokenizer, tail, self.stop)
                          else "budget" if written[r] + step + 1 >= budget else "")
                if reason:
                    why[r] = reason
                out.append(bool(reason))
            return torch.tensor(out, dtype=torch.bool, device=rows.device)

        return end

    def _truncate(self, env: EpisodeEnv, rec: EpisodeRecord, reason: str) -> None:
        rec.truncated = reason
        rec.reward = check_reward(env, self._call_env(env, rec, "truncated_reward",
                                                      lambda: truncated_reward(env, rec.state)),
                                  f"(truncated_reward) for the episode of {_row_where(rec)}")

    def _output(self, records: list[EpisodeRecord], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                params: SamplingParams) -> MultiTurnOutput:
        return layout_episodes(records, input_ids, attention_mask, params.resolved_pad_token_id,
                               next(self.model.parameters()).device)


def layout_episodes(records: list[EpisodeRecord], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pad: int,
                    device: torch.device) -> MultiTurnOutput:
    """The episodes as a rollout batch: their (left-padded) prompts and, right-padded after them, the tokens each
    wrote and read, with the loss mask, the attention and the sampler's log-probs."""
    width = max(max((len(r.tokens) for r in records), default=1), 1)
    e = len(records)
    response = torch.full((e, width), pad, dtype=torch.long)
    loss_mask = torch.zeros((e, width), dtype=torch.long)
    attn = torch.zeros((e, width), dtype=torch.long)
    logprobs = torch.zeros((e, width), dtype=torch.float32)
    for i, r in enumerate(records):
        k = len(r.tokens)
        response[i, :k] = torch.tensor(r.tokens, dtype=torch.long)
        loss_mask[i, :k] = torch.tensor(r.loss_mask, dtype=torch.long)
        attn[i, :k] = 1
        logprobs[i, :k] = torch.tensor(r.logprobs, dtype=torch.float32)
    rewards = torch.tensor([r.reward for r in records], dtype=torch.float32)
    return MultiTurnOutput(
        prompt_ids=prompt_ids.to(device=device, dtype=torch.long), prompt_mask=prompt_mask.to(device).long(),
        response_ids=response.to(device), response_mask=loss_mask.to(device),
        response_attention_mask=attn.to(device), logprobs=logprobs.to(device),
        finished=torch.tensor([r.finished for r in records], dtype=torch.bool, device=device),
        rewards=rewards.to(device), episodes=records)


__all__ = ["EpisodeRecord", "MultiTurnOutput", "MultiTurnRollout", "layout_episodes"]
