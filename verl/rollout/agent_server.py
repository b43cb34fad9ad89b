"""An OpenAI-compatible endpoint served from the rollout engine, so that agent code written against an OpenAI
client trains unchanged: point its `base_url` at the trainer.

During a rollout, `AgentServer` serves `POST /v1/chat/completions` and `POST /v1/completions` (and
`GET /v1/models`) on 127.0.0.1 with FastAPI on uvicorn, in a thread of its own. Each episode gets its own
base URL (`http://127.0.0.1:PORT/episodes/ID/v1`), so the calls of one episode are known to belong together.
Requests only queue: the trainer's thread takes whatever is pending, groups it by sampling parameters and
samples each group as one batch on the engine (`serve_until`), so concurrent agents share the model's batch.

Token in, token out. Every call's prompt ids, sampled ids and log-probs are recorded. A chat request whose
history up to its last assistant message renders exactly as the episode's previous prompt did gets that
assistant turn as the tokens the model sampled (not the agent's re-rendering of them, which may differ:
spacing in a tool call, a dropped special token), followed by the tokens of what came after (tool results,
a user turn, the next assistant header). The calls of an episode thus form one sequence: the first prompt,
then model tokens (trained on) and the tokens between them (read, not trained on), whose log-probs one
forward reproduces. A call that does not continue the sequence (the agent rewrote the history, or a
template that re-renders earlier turns) starts a new one; the episode trains on its last sequence and the
break is counted (`agent/restarted_calls`).
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.errors import ConfigError
from verl.rollout.base import SamplingParams
from verl.rollout.tool_parsers import ToolCallFormat
from verl.utils.chat_render import render_chat, turn_end

INSTALL_HINT = "pip install 'verl[agent]' (fastapi, uvicorn and the openai client)"


def require_server_libraries() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"env.agent serves an OpenAI-compatible endpoint with FastAPI on uvicorn, which are not "
                          f"installed ({e.name}): {INSTALL_HINT}") from None


@dataclass
class Sampled:
    ids: list[int]  # the sampled tokens, eos included when the model wrote it
    logprobs: list[float]
    eos: bool  # ended by an eos token (else by max_tokens)


# What the trainer's thread runs for a batch of prompts with one set of sampling parameters.
SampleFn = Callable[[list[list[int]], SamplingParams], list[Sampled]]


@dataclass
class EpisodeTokens:
    """One episode's calls, stitched into token sequences."""

    prompt: list[int] = field(default_factory=list)  # the sequence's first prompt
    response: list[int] = field(default_factory=list)  # everything after it
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the model
    logprobs: list[float] = field(default_factory=list)
    last_prompt_text: str | None = None  # the rendering the last chat call's prompt was built from
    last_ids: list[int] = field(default_factory=list)  # the last call's whole sequence (prompt + sampled)
    last_eos: bool = True
    calls: int = 0
    restarted: int = 0  # calls that could not continue the sequence
    refused: int = 0  # calls over the budget
    final_text: str = ""  # the last completion's text

    def begin(self, prompt: list[int]) -> None:
        if self.calls:
            self.restarted += 1
        self.prompt, self.response, self.loss_mask, self.logprobs = list(prompt), [], [], []

    def extend(self, between: list[int]) -> None:
        self.response += between
        self.loss_mask += [0] * len(between)
        self.logprobs += [0.0] * len(between)

    def add_sample(self, prompt: list[int], sample: Sampled, text: str) -> None:
        self.response += sample.ids
        self.loss_mask += [1] * len(sample.ids)
        self.logprobs += sample.logprobs
        self.last_ids, self.last_eos, self.final_text = prompt + sample.ids, sample.eos, text
        self.calls += 1


@dataclass
class _Pending:
    episode: EpisodeTokens
    prompt: list[int]
    params: SamplingParams
    done: Callable[[Sampled | BaseException], None]


class AgentServer:
    """The endpoint for one rollout: `episode_url(id)` per episode, `serve_until(finished)` on the trainer's
    thread, `close()` after (see the module docstring)."""

    def __init__(self, tokenizer: Any, sample: SampleFn, *, eos_token_ids: Sequence[int], max_tokens: int,
                 temperature: float, tool_format: ToolCallFormat | None = None, call_budget: int = 32,
                 max_batch: int = 256, model_name: str = "verl-policy") -> None:
        require_server_libraries()
        self.tokenizer, self.sample, self.eos = tokenizer, sample, list(eos_token_ids)
        self.max_tokens, self.temperature, self.tool_format = max_tokens, temperature, tool_format
        self.call_budget, self.max_batch, self.model_name = call_budget, max_batch, model_name
        self.episodes: dict[str, EpisodeTokens] = {}
        self.pending: queue.Queue[_Pending] = queue.Queue()
        self.largest_batch = 0  # the most requests sampled together
        self.failure: Exception | None = None  # the first sampling error (raised by the rollout once it ends)
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))  # a free port, held from here on (no other process can take it)
        self.port = self._socket.getsockname()[1]
        self._server, self._thread = self._start()

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> tuple[Any, threading.Thread]:
        import uvicorn

        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=lambda: server.run(sockets=[self._socket]), name="verl-agent-server",
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"the agent endpoint did not start on 127.0.0.1:{self.port}")
            time.sleep(0.01)
        return server, thread

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def episode_url(self, episode_id: str) -> str:
        self.episodes.setdefault(episode_id, EpisodeTokens())
        return f"http://127.0.0.1:{self.port}/episodes/{episode_id}/v1"

    # ------------------------------------------------------------------ sampling (the trainer's thread)
    def serve_until(self, finished: Callable[[], bool], running: Callable[[], int] | None = None,
                    poll_s: float = 0.002, wait_s: float = 0.05) -> None:
        """Sample what the agents ask for, in batches, until `finished()`. A batch waits for the next requests
        until every episode still `running()` has one pending, at most `wait_s`: the episodes of a step ask at
        about the same moment, and one batch of them costs about what one request alone does."""
        while not finished():
            try:
                first = self.pending.get(timeout=poll_s)
            except queue.Empty:
                continue
            batch, deadline = [first], time.monotonic() + wait_s
            while len(batch) < self.max_batch and (running is None or len(batch) < running()):
                try:
                    batch.append(self.pending.get(timeout=max(deadline - time.monotonic(), 0.0)))
                except queue.Empty:
                    break
            self.largest_batch = max(self.largest_batch, len(batch))
            groups: dict[tuple, list[_Pending]] = {}
            for p in batch:
                groups.setdefault((p.params.temperature, p.params.top_p, p.params.max_new_tokens), []).append(p)
            for group in groups.values():
                try:
                    results: list[Sampled | BaseException] = list(
                        self.sample([p.prompt for p in group], group[0].params))
                except Exception as e:  # noqa: BLE001 - the agents get an error; the rollout raises it after
                    self.failure = self.failure or e
                    results = [e] * len(group)
                for p, result in zip(group, results, strict=True):
                    p.done(result)

    # ------------------------------------------------------------------ the HTTP side (the server's thread)
    def _app(self) -> Any:
        from fastapi import Body, FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI()

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)

        @app.get("/episodes/{episode_id}/v1/models")
        async def models(episode_id: str) -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "verl"}]}

        async def run(episode_id: str, body: Mapping[str, Any], chat: bool) -> Any:
            episode = self.episodes.get(episode_id)
            if episode is None:
                return error(404, f"no episode {episode_id!r} in this rollout")
            if int(body.get("n", 1) or 1) != 1:
                return error(400, "n must be 1: each call is one sample of the episode")
            if episode.calls >= self.call_budget:
                episode.refused += 1
                return error(429, f"the episode's call budget ({self.call_budget} calls) is spent")
            try:
                params = self._params(body)
                prompt, text = self._chat_prompt(episode, body) if chat else self._completion_prompt(episode, body)
            except Exception as e:  # noqa: BLE001 - a malformed request or messages the chat template rejects
                return error(400, f"the request could not be turned into a prompt: {type(e).__name__}: {e}")
            loop = asyncio.get_running_loop()
            future: asyncio.Future = loop.create_future()

            def done(result: Sampled | BaseException) -> None:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

            self.pending.put(_Pending(episode, prompt, params, done))
            result = await future
            if isinstance(result, BaseException):
                return error(500, f"sampling failed: {type(result).__name__}: {result}")
            completion = self.tokenizer.decode(result.ids, skip_special_tokens=True)
            episode.last_prompt_text = text
            episode.add_sample(prompt, result, completion)
            return self._response(result, completion, len(prompt), chat)

        # (annotations are strings here: the body is declared by its default, not by an imported type)
        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat_completions(episode_id: str, body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008
            return await run(episode_id, body, chat=True)

        @app.post("/episodes/{episode_id}/v1/completions")
        async def completions(episode_id: str, body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008
            return await run(episode_id, body, chat=False)

        return app

    def _params(self, body: Mapping[str, Any]) -> SamplingParams:
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_tokens
        temperature = body.get("temperature")
        return SamplingParams(temperature=float(self.temperature if temperature is None else temperature),
                              top_p=float(body.get("top_p") or 1.0), max_new_tokens=min(int(limit), self.max_tokens),
                              eos_token_ids=self.eos, pad_token_id=self.tokenizer.pad_token_id)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_prompt(self, episode: EpisodeTokens, body: Mapping[str, Any]) -> tuple[list[int], str]:
        """The prompt ids of a chat call: the episode's sequence continued where the history allows it."""
        messages, tools = list(body["messages"]), body.get("tools")
        text = render_chat(self.tokenizer, messages, tools=tools, add_generation_prompt=True)
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if episode.last_prompt_text is not None and last is not None:
            before = render_chat(self.tokenizer, messages[:last], tools=tools, add_generation_prompt=True)
            through = render_chat(self.tokenizer, messages[: last + 1], tools=tools, add_generation_prompt=False)
            end = turn_end(through, len(before), self.tokenizer.convert_ids_to_tokens(self.eos))
            if before == episode.last_prompt_text and end is not None and text.startswith(through[:end]):
                between = ([] if episode.last_eos else self.eos[:1]) + self._encode(text[end:])
                episode.extend(between)
                return episode.last_ids + between, text
        prompt = self._encode(text)
        episode.begin(prompt)
        return prompt, text

    def _completion_prompt(self, episode: EpisodeTokens, body: Mapping[str, Any]) -> tuple[list[int], str]:
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else self._encode(str(prompt))
        if episode.calls and ids[: len(episode.last_ids)] == episode.last_ids:
            episode.extend(ids[len(episode.last_ids):])
        else:
            episode.begin(ids)
        return ids, ""

    def _response(self, sample: Sampled, completion: str, prompt_tokens: int, chat: bool) -> dict[str, Any]:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(sample.ids),
                 "total_tokens": prompt_tokens + len(sample.ids)}
        finish = "stop" if sample.eos else "length"
        head = {"id": f"verl-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": self.model_name,
                "usage": usage}
        if not chat:
            return head | {"object": "text_completion",
                           "choices": [{"index": 0, "text": completion, "finish_reason": finish, "logprobs": None}]}
        message: dict[str, Any] = {"role": "assistant", "content": completion}
        if self.tool_format is not None:
            parsed = self.tool_format.parse(completion)
            if parsed.calls:
                message = {"role": "assistant", "content": parsed.content or None, "tool_calls": [
                    {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]}
                finish = "tool_calls"
        return head | {"object": "chat.completion",
                       "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}


__all__ = ["AgentServer", "EpisodeTokens", "INSTALL_HINT", "Sampled", "require_server_libraries"]
