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

from verl.errors import ConfigError, EnvError, VerlError
from verl.rollout.base import SamplingParams
from verl.rollout.episode import Done, Observation, check_reward, env_name, truncated_reward
from verl.rollout.hf_engine import HFKVCacheEngine
from verl.rollout.sampling import sample_step
from verl.utils.positions import position_ids_from_mask

try:
    from verl.rollout.hf_engine import Cache, DynamicCache, _PreallocatedLayer
except ImportError:  # pragma: no cover - transformers without per-layer caches
    _PreallocatedLayer = None  # type: ignore[assignment,misc]


if _PreallocatedLayer is not None:

    class _GrowingLayer(_PreallocatedLayer):
        """The rollout cache layer, grown (doubled) when an episode needs more columns than planned:
        how many turns and how long the observations are is only known while the episodes run."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self.is_initialized and self.length + key_states.shape[-2] > self.capacity:
                capacity = max(self.length + key_states.shape[-2], 2 * self.capacity)
                for name in ("key_buf", "value_buf"):
                    old = getattr(self, name)
                    new = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
                    new[:, :, : self.length] = old[:, :, : self.length]
                    setattr(self, name, new)
                self.capacity = capacity
            return super().update(key_states, value_states, *args, **kwargs)

    class _GrowingCache(DynamicCache):
        def __init__(self, num_layers: int, capacity: int) -> None:
            Cache.__init__(self, layers=[_GrowingLayer(capacity) for _ in range(num_layers)])

        def park(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
            """Copies of these rows' keys and values (every layer), taken out of the decode batch."""
            return [(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in self.layers]

        def unpark(self, parked: Sequence[list[tuple[torch.Tensor, torch.Tensor]]], order: torch.Tensor) -> None:
            """The batch becomes (its rows, then every parked group's rows)[order]. A parked row is shorter
            than the others by the steps it sat out: its missing columns are zero-filled holes (the caller
            masks them), so later tokens attend to exactly its real columns."""
            for i, layer in enumerate(self.layers):
                length = layer.length
                for name, j in (("key_buf", 0), ("value_buf", 1)):
                    buf = getattr(layer, name)
                    rows = [buf[:, :, :length]]
                    for group in parked:
                        kv = group[i][j]
                        rows.append(torch.nn.functional.pad(kv, (0, 0, 0, length - kv.shape[2])))
                    merged = buf.new_empty(len(order), buf.shape[1], layer.capacity, buf.shape[3])
                    merged[:, :, :length] = torch.cat(rows).index_select(0, order)
                    setattr(layer, name, merged)
                layer._refresh_views()


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


def _stop_hit(tokenizer: Any, turn: list[int], stop: Sequence[str], window: int) -> bool:
    """Whether the turn's decoded text now contains a stop string. Tokenizers merge characters across token
    boundaries, so the check runs on the decoded suffix of the turn (a stop string can only have appeared
    with the latest token: the earlier suffixes were checked already)."""
    if not stop:
        return False
    text = tokenizer.decode(turn[-window:], skip_special_tokens=False)
    return any(s in text for s in stop)


class MultiTurnRollout:
    """Runs batches of episodes of a multi-turn environment on an `HFKVCacheEngine`'s model."""

    def __init__(self, engine: Any, tokenizer: Any, stop: Sequence[str] = ()) -> None:
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
    def _call_env(self, env: Any, record: EpisodeRecord, what: str, fn: Callable[[], Any]) -> Any:
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

    def start(self, env: Any, rows: Sequence[Mapping[str, Any]], n: int) -> tuple[list[Any], list[EpisodeRecord]]:
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
    def run(self, env: Any, records: list[EpisodeRecord], input_ids: torch.Tensor, attention_mask: torch.Tensor,
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

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.engine.forward_step(ids, mask.long(), positions, cache)

    def _run(self, env: Any, records: list[EpisodeRecord], input_ids: torch.Tensor, attention_mask: torch.Tensor,
             params: SamplingParams, generator: torch.Generator | None, budget: int, max_turns: int) -> None:
        param = next(self.model.parameters())
        device = param.device
        ids = input_ids.to(device=device, dtype=torch.long)
        cols = attention_mask.to(device=device).bool()  # [A, C]: which cache columns are real tokens
        prompt_len = ids.shape[1]
        eos = set(params.eos_token_ids)
        pad = params.resolved_pad_token_id
        temperature, top_k, top_p = float(params.temperature), params.top_k, float(params.top_p)
        if _PreallocatedLayer is not None and self.engine.preallocates:
            cache = _GrowingCache(int(self.engine.text_config.num_hidden_layers), prompt_len + budget + 16)
        else:
            cache = self.engine.new_cache()
        parks = hasattr(cache, "park")  # else (sliding-window layouts) a row that sat out keeps holes instead
        positions = position_ids_from_mask(cols)
        logits = self._forward(ids.masked_fill(~cols, 0), cols, positions, cache)  # [A, V] after the last real token
        next_pos = positions[:, -1] + 1  # [A]
        active = list(range(len(records)))  # the record of each cache row

        for turn in range(1, max_turns + 1):
            for i in active:
                records[i].turns = turn
                records[i].turn_tokens = []
            ended: dict[int, str] = {}  # record -> why its turn ended: "stop", "eos", "budget", "max_new_tokens"
            last: dict[int, int] = {}  # record -> the turn's last token, fed with the observation that follows it
            parked: list[tuple[list[int], Any, torch.Tensor, torch.Tensor]] = []  # (records, cache, cols, next_pos)
            rows = list(active)  # the record of each row of the decode batch
            writing = torch.ones(len(rows), dtype=torch.bool, device=device)
            for step in range(params.max_new_tokens):
                idx = writing.nonzero().flatten()
                tokens, logp = sample_step(logits[idx], temperature, top_k, top_p, generator)
                for r, tok, lp in zip(idx.tolist(), tokens.tolist(), logp.tolist(), strict=True):
                    rec = records[rows[r]]
                    rec.tokens.append(tok)
                    rec.loss_mask.append(1)
                    rec.logprobs.append(lp)
                    rec.turn_tokens.append(tok)
                    reason = ("eos" if tok in eos else "stop" if _stop_hit(self.tokenizer, rec.turn_tokens,
                                                                           self.stop, self.window)
                              else "budget" if len(rec.tokens) >= budget
                              else "max_new_tokens" if step == params.max_new_tokens - 1 else "")
                    if reason:
                        ended[rows[r]], last[rows[r]] = reason, tok
                        writing[r] = False
                if not bool(writing.any()):
                    break
                feed = torch.full((len(rows),), pad, dtype=torch.long, device=device)
                feed[idx] = tokens
                if parks and not bool(writing.all()):
                    # Rows whose turn ended sit the rest of it out: their cache rows are set aside, so the
                    # decode steps of the others do not compute them.
                    out, go = (~writing).nonzero().flatten(), writing.nonzero().flatten()
                    parked.append(([rows[r] for r in out.tolist()], cache.park(out), cols[out], next_pos[out]))
                    cache.batch_select_indices(go)
                    rows = [rows[r] for r in go.tolist()]
                    cols, logits, next_pos, feed, writing = cols[go], logits[go], next_pos[go], feed[go], writing[go]
                cols = torch.cat([cols, writing.unsqueeze(1)], dim=1)  # a hole for a row that sits out
                step_logits = self._forward(feed.unsqueeze(1), cols, next_pos.unsqueeze(1), cache)
                logits = torch.where(writing.unsqueeze(1), step_logits, logits)
                next_pos = next_pos + writing.long()

            # The environment answers every episode whose turn ended by a stop string or eos.
            keep: list[int] = []
            blocks: list[list[int]] = []
            for i in active:
                rec = records[i]
                text = self.tokenizer.decode(rec.turn_tokens, skip_special_tokens=True)
                rec.transcript.append(("model", text))
                if ended[i] in ("budget", "max_new_tokens"):
                    self._truncate(env, rec, ended[i])
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
                blocks.append([last[i]] + obs)
            if not keep:
                return
            # Episodes that ended leave the batch and the cache; rows that sat out rejoin it, in episode order.
            where = {rec: k for k, rec in enumerate(rows + [i for group in parked for i in group[0]])}
            order = torch.tensor([where[i] for i in keep], dtype=torch.long, device=device)
            if parked:
                cache.unpark([group[1] for group in parked], order)
                width = cols.shape[1]
                cols = torch.cat([cols] + [torch.cat([c, c.new_zeros(c.shape[0], width - c.shape[1])], dim=1)
                                           for _, _, c, _ in parked])[order]
                next_pos = torch.cat([next_pos] + [p for *_, p in parked])[order]
            elif len(keep) < len(rows):
                cache.batch_select_indices(order)
                cols, next_pos = cols[order], next_pos[order]
            active = keep
            # Each turn's last token and the observation after it, right-aligned behind holes: the block's
            # last column is every row's latest real token.
            width = max(len(b) for b in blocks)
            block = torch.full((len(keep), width), pad, dtype=torch.long, device=device)
            block_mask = torch.zeros((len(keep), width), dtype=torch.bool, device=device)
            for r, b in enumerate(blocks):
                block[r, width - len(b):] = torch.tensor(b, dtype=torch.long, device=device)
                block_mask[r, width - len(b):] = True
            block_pos = next_pos.unsqueeze(1) + (block_mask.long().cumsum(1) - 1).clamp(min=0)
            cols = torch.cat([cols, block_mask], dim=1)
            logits = self._forward(block, cols, block_pos, cache)
            next_pos = next_pos + block_mask.long().sum(1)

    def _truncate(self, env: Any, rec: EpisodeRecord, reason: str) -> None:
        rec.truncated = reason
        rec.reward = check_reward(env, self._call_env(env, rec, "truncated_reward",
                                                      lambda: truncated_reward(env, rec.state)),
                                  f"(truncated_reward) for the episode of {_row_where(rec)}")

    def _output(self, records: list[EpisodeRecord], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                params: SamplingParams) -> MultiTurnOutput:
        device = next(self.model.parameters()).device
        width = max(max((len(r.tokens) for r in records), default=1), 1)
        e = len(records)
        pad = params.resolved_pad_token_id
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
            prompt_ids=input_ids.to(device=device, dtype=torch.long), prompt_mask=attention_mask.to(device).long(),
            response_ids=response.to(device), response_mask=loss_mask.to(device),
            response_attention_mask=attn.to(device), logprobs=logprobs.to(device),
            finished=torch.tensor([r.finished for r in records], dtype=torch.bool, device=device),
            rewards=rewards.to(device), episodes=records)


__all__ = ["EpisodeRecord", "MultiTurnOutput", "MultiTurnRollout"]
