"""Episodes of agent code that talks to the policy through an OpenAI-compatible endpoint (`env.agent`).

    # my_agent.py                                   # env: {name: arithmetic, agent: my_agent.py:run}
    from openai import AsyncOpenAI

    async def run(row, base_url):
        client = AsyncOpenAI(base_url=base_url, api_key="verl")
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        return float(reply.choices[0].message.content.strip() == row["ground_truth"])

For every prompt of the batch, n episodes run concurrently: each calls `run(row, base_url)` with a base URL of
its own (`verl.rollout.agent_server`), makes any number of calls, and returns its reward (or None: the
environment's reward over the last reply). The calls are sampled in batches on the rollout engine and
stitched, token for token, into the episode's training sequence. Each call samples with uniform numbers of its
own, drawn from a seed of (the rollout's draw from the trainer's generator, its episode, its call number): which
calls share a batch depends on when the agents make them, but what a call samples does not, so a run is
reproducible for a seed up to float rounding (batches of other widths may round a logit differently).
An episode that runs past `env.agent_timeout_s` ends with reward 0 and is trained on what it wrote; one whose
agent raises is not trained on (its tokens are masked), its traceback goes to the samples and
`episode/agent_failed` counts it: neither stops the run.
With rollout ranks of their own (asynchronous RL) all this runs there, next to the engine, and the episodes
travel to the actor ranks (`verl.rollout.async_rollout`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import math
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.data.tool_parsers import tool_call_format
from verl.data.tool_template import prefix_preserving
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment, is_multiturn
from verl.errors import ConfigError
from verl.rollout import SamplingParams
from verl.rollout.agent_server import AgentServer, EpisodeTokens, Sampled, require_server_libraries
from verl.rollout.episodes import Episodes
from verl.rollout.multiturn import EpisodeRecord, MultiTurnOutput, layout_episodes
from verl.utils.user_code import exec_user_file, resolve_user_path

AgentFn = Callable[[dict[str, Any], str], Any]


def load_agent(spec: str, base_dir: str | None) -> AgentFn:
    """`path/to/file.py:function`: an `async def function(row, base_url)`, checked before anything loads."""
    def fail(message: str) -> ConfigError:
        return ConfigError(f"env.agent={spec!r}: {message}")

    path_text, _, name = spec.rpartition(":")
    if not path_text or not name or not path_text.endswith(".py"):
        raise fail("expected 'path/to/agent.py:function', e.g. 'my_agent.py:run'")
    module = exec_user_file(resolve_user_path(path_text, base_dir, what="agent file", fail=fail),
                            namespace="agent", label="agent file", fail=fail)
    fn = getattr(module, name, None)
    if fn is None:
        found = [n for n, v in vars(module).items() if inspect.iscoroutinefunction(v)]
        raise fail(f"{path_text} has no function {name!r} (its async functions: {found or 'none'})")
    if not inspect.iscoroutinefunction(fn):
        raise fail(f"{name} must be an async function (async def {name}(row, base_url)), so that episodes run "
                   "concurrently")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values()):
        raise fail(f"{name}{inspect.signature(fn)} must take (row, base_url): the prompt row and the OpenAI base "
                   "URL of its episode")
    return fn


def agent_problems(config: RunConfig) -> list[ConfigError]:
    """`env.agent` checked at start-up: the file and function, the server libraries."""
    if config.env.agent is None:
        return []
    problems = []
    try:
        require_server_libraries()
    except ConfigError as exc:
        problems.append(exc)
    try:
        load_agent(config.env.agent, config._source_dir)
    except ConfigError as exc:
        problems.append(exc)
    if config.rollout.engine != "hf":
        problems.append(ConfigError(f"env.agent samples on the 'hf' rollout engine; rollout.engine="
                                    f"{config.rollout.engine} is not supported with it yet. Fix: rollout.engine=hf"))
    return problems


@dataclass
class _Outcome:
    reward: float | None = None
    failed: str = ""  # the agent's traceback
    timed_out: bool = False
    running: bool = False  # the agent is between its start and its return


class AgentEpisodes(Episodes):
    """`Episodes` whose turns are an agent's calls to the endpoint (see the module docstring)."""

    env: Environment  # single-turn: its compute_reward scores an episode whose agent returned None
    agent: AgentFn
    config: RunConfig

    @classmethod
    def for_agent(cls, config: RunConfig, env: Environment, engine: Any, prompts: Any, *, policy: torch.nn.Module,
                  gathered: Any, device: torch.device) -> AgentEpisodes | None:
        if engine is None:
            return None
        out = cls(None, env, prompts, policy, gathered, device)
        out.agent, out.config, out.engine = load_agent(config.env.agent, config._source_dir), config, engine
        preserving, why = prefix_preserving(prompts.tokenizer)
        if not preserving:  # the endpoint continues an episode's sequence only where the history renders the same
            warnings.warn(f"env.agent: the chat template is not prefix-preserving: {why}; an agent's calls after "
                          "such a turn start new sequences (episode/agent_restarted_calls)", stacklevel=2)
        return out

    def run(self, rows: Sequence[Mapping[str, Any]], n: int, params: SamplingParams,
            generator: torch.Generator | None) -> MultiTurnOutput:
        e = self.config.env
        model = getattr(self.engine, "text_config", None)  # what a request must fit: the model's vocabulary, context
        server = AgentServer(self.prompts.tokenizer, self._sampler(generator), eos_token_ids=params.eos_token_ids,
                             max_tokens=params.max_new_tokens, temperature=params.temperature,
                             tool_format=tool_call_format(e.tool_call_format), call_budget=e.agent_call_budget,
                             vocab_size=getattr(model, "vocab_size", None),
                             max_length=getattr(model, "max_position_embeddings", None),
                             max_body_bytes=e.agent_max_body_bytes)
        episodes = [(i, row, f"{i}-{k}") for i, row in enumerate(rows) for k in range(n)]
        urls = [server.episode_url(eid) for _, _, eid in episodes]
        outcomes = [_Outcome() for _ in episodes]
        worker = threading.Thread(target=lambda: asyncio.run(self._agents(episodes, urls, outcomes)),
                                  name="verl-agents", daemon=True)
        try:
            with self.gathered(self.policy):
                worker.start()
                server.serve_until(lambda: not worker.is_alive(),
                                   running=lambda: sum(o.running for o in outcomes))
            worker.join()
        finally:
            server.close()
        if server.failure is not None:  # the engine sampled no call at all: not one agent's fault
            raise server.failure
        return self._output(episodes, [server.episodes[eid] for _, _, eid in episodes], outcomes, params)

    async def _agents(self, episodes: list[tuple[int, Mapping[str, Any], str]], urls: list[str],
                      outcomes: list[_Outcome]) -> None:
        e = self.config.env
        gate = asyncio.Semaphore(e.agent_concurrency)

        async def one(i: int) -> None:
            async with gate:
                outcomes[i].running = True
                try:
                    reward = await asyncio.wait_for(self.agent(dict(episodes[i][1]), urls[i]), e.agent_timeout_s)
                    outcomes[i].reward = None if reward is None else float(reward)
                except asyncio.TimeoutError:
                    outcomes[i].timed_out = True
                except Exception:  # noqa: BLE001 - the agent's failure fails its episode, not the run
                    outcomes[i].failed = traceback.format_exc(limit=8)
                finally:
                    outcomes[i].running = False

        await asyncio.gather(*(one(i) for i in range(len(episodes))))

    def _sampler(self, generator: torch.Generator | None) -> Callable[[list[list[int]], SamplingParams, list[str]],
                                                                      list[Sampled]]:
        """Samples a batch of prompts on the engine, each call with the uniform numbers of its key (see the module
        docstring). The n episodes of a row open with the same prompt: when every prompt of the batch comes equally
        often, each is prefilled once and sampled that many times."""
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))  # one draw per rollout, however it batches

        def sample(prompts: list[list[int]], params: SamplingParams, keys: list[str]) -> list[Sampled]:
            where: dict[tuple[int, ...], list[int]] = {}
            for i, p in enumerate(prompts):
                where.setdefault(tuple(p), []).append(i)
            copies = {len(rows) for rows in where.values()}
            order = list(range(len(prompts)))  # the engine's rows, as indices into prompts
            if len(copies) == 1 and (n := copies.pop()) > 1:
                order = [i for rows in where.values() for i in rows]  # each prompt n times, in turn
                prompts, params = [list(p) for p in where], replace(params, n=n)
            out = self._generate(prompts, params, call_noise(seed, [keys[i] for i in order], params.max_new_tokens))
            return [out[order.index(i)] for i in range(len(order))]

        return sample

    def _generate(self, prompts: list[list[int]], params: SamplingParams, noise: torch.Tensor) -> list[Sampled]:
        width = max(len(p) for p in prompts)
        pad = self.prompts.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        out = self.engine.generate(ids, mask, params, noise=noise)
        lengths = out.response_mask.sum(-1).tolist()
        return [Sampled(out.response_ids[r, :k].tolist(), out.logprobs[r, :k].tolist(), bool(out.finished[r]))
                for r, k in enumerate(lengths)]

    def _output(self, episodes: list[tuple[int, Mapping[str, Any], str]], tokens: list[EpisodeTokens],
                outcomes: list[_Outcome], params: SamplingParams) -> MultiTurnOutput:
        records = []
        for (index, row, _), seq, outcome in zip(episodes, tokens, outcomes, strict=True):
            record = EpisodeRecord(row=row, row_index=index, state=None)
            if not seq.prompt:  # no call made: the row's prompt, nothing to train on
                ids, mask = self.prompts.encode([row])
                seq.prompt = ids[0][mask[0].bool()].tolist()
            record.tokens, record.logprobs = list(seq.response), list(seq.logprobs)
            record.loss_mask = [0] * len(seq.response) if outcome.failed else list(seq.loss_mask)
            record.turns = seq.calls
            record.finished = not (outcome.failed or outcome.timed_out)
            record.truncated = "timeout" if outcome.timed_out else ""
            reward = outcome.reward
            if reward is None and record.finished:
                reward = float(self.env.compute_reward([row], [seq.final_text]).scores[0])
            record.reward = reward if reward is not None and math.isfinite(reward) else 0.0
            record.info = {"agent_failed": bool(outcome.failed), "agent_timeout": outcome.timed_out,
                           "agent_calls": seq.calls, "agent_restarted_calls": seq.restarted,
                           "agent_refused_calls": seq.refused, "agent_rejected_calls": seq.rejected}
            record.transcript = [("agent", outcome.failed)] if outcome.failed else []
            records.append((seq.prompt, record))
        return _layout(records, params, self.device)

    def texts(self, out: MultiTurnOutput) -> list[str]:
        """The episodes as text; a failed agent's traceback after its episode."""
        texts = super().texts(out)
        return [t + (f"\n[agent failed]\n{e.transcript[0][1]}" if e.info.get("agent_failed") else "")
                for t, e in zip(texts, out.episodes, strict=True)]


def call_noise(seed: int, keys: Sequence[str], steps: int) -> torch.Tensor:
    """[steps, len(keys)] uniform numbers in [0, 1), float64, each column from a generator seeded by (seed, key):
    a call's own, whatever else shares its batch."""
    columns = []
    for key in keys:
        digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        columns.append(torch.rand(steps, generator=g, dtype=torch.float64))
    return torch.stack(columns, dim=1)


def _layout(records: list[tuple[list[int], EpisodeRecord]], params: SamplingParams,
            device: torch.device) -> MultiTurnOutput:
    """The episodes' prompts (each its first call's, left-padded) and everything after them."""
    width = max(len(p) for p, _ in records)
    pad = params.resolved_pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in records], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in records], dtype=torch.long)
    return layout_episodes([r for _, r in records], prompt_ids, prompt_mask, pad, device)


def episodes_for(config: RunConfig, env: Environment | MultiTurnEnvironment, engine: Any, prompts: Any,
                 **parts: Any) -> Episodes | None:
    """This rank's episode runner: an agent's (`env.agent`), a multi-turn environment's, or None (single turn)."""
    if config.env.agent is not None:
        return AgentEpisodes.for_agent(config, env, engine, prompts, **parts)
    if is_multiturn(env):
        return Episodes.create(env, engine, prompts, config.rollout.stop, **parts)
    return None


__all__ = ["AgentEpisodes", "agent_problems", "episodes_for", "load_agent"]
