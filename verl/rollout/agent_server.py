"""An OpenAI-compatible endpoint served from the rollout engine, so that agent code written against an OpenAI
client trains unchanged: point its `base_url` at the trainer.

During a rollout, `AgentServer` serves `POST /v1/chat/completions` and `POST /v1/completions` (and
`GET /v1/models`) on 127.0.0.1 with FastAPI on uvicorn, in a thread of its own. Each episode gets its own
base URL (`http://127.0.0.1:PORT/episodes/ID/KEY/v1`), so the calls of one episode are known to belong together.
Requests only queue: the trainer's thread takes whatever is pending, groups it by sampling parameters and
samples each group as one batch on the engine (`serve_until`), so concurrent agents share the model's batch.
Each call goes to the sampler with its key (episode id and call number), so that what it samples can be made to
depend on the call alone, not on which others share its batch or when they arrived (`AgentEpisodes`).

Any local process can reach the port, so the endpoint serves only its episodes' agents: KEY is an unguessable
secret of the episode (a call without it gets 401 and touches nothing), the body is capped before it is read
(`max_body_bytes`, 413), every field is checked (400 naming it: token ids inside the vocabulary, prompt +
max_tokens inside the model's context, temperature, top_p, n, messages, no streaming), an episode's calls past
`call_budget` get 429, and parsing and tokenising run off the event loop. A call the engine cannot sample fails
that call only; the rollout raises only when the engine sampled none.

Token in, token out. Every call's prompt ids, sampled ids and log-probs are recorded. A chat request whose
history up to its last assistant message renders exactly as the episode's previous prompt did gets that
assistant turn as the tokens the model sampled (not the agent's re-rendering of them, which may differ:
spacing in a tool call, a dropped special token), followed by the tokens of what came after (tool results,
a user turn, the next assistant header). The calls of an episode thus form one sequence (they are taken one
at a time): the first prompt, then model tokens (trained on) and the tokens between them (read, not trained
on), whose log-probs one forward reproduces. A call that does not continue the sequence (the agent rewrote
the history, or a template that re-renders earlier turns) starts a new one; the episode trains on its last
sequence and the break is counted (`agent/restarted_calls`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.data.tool_parsers import ToolCallFormat
from verl.errors import ConfigError, install_hint
from verl.rollout.base import SamplingParams
from verl.utils.chat_render import render_chat, turn_end
from verl.utils.tokenizer_protocol import Tokenizer

INSTALL_HINT = install_hint("fastapi uvicorn openai", "agent")


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


# What the trainer's thread runs for a batch of prompts with one set of sampling parameters, each prompt with its
# call's key ("episode id/call number"): what a call samples may depend on its key, never on its batch.
SampleFn = Callable[[list[list[int]], SamplingParams, list[str]], list[Sampled]]


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
    calls: int = 0  # calls sampled
    admitted: int = 0  # calls counted against the budget (every call with the episode's key, until it is spent)
    restarted: int = 0  # calls that could not continue the sequence
    refused: int = 0  # calls over the budget
    rejected: int = 0  # admitted calls answered with an error (a bad request, a failed sample)
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
class _Prompt:
    """A call's prompt, and how it joins its episode once sampled: `between` continues the sequence, None
    begins a new one."""

    ids: list[int]
    text: str
    between: list[int] | None


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    done: Callable[[Sampled | BaseException], None]
    key: str  # "episode id/call number": the episode's calls are sampled one at a time, so this is its Nth


class _Refused(Exception):
    """A call answered with an error before (or instead of) its sample: status, message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _real(body: Mapping[str, Any], name: str, default: float, ok: Callable[[float], bool], rule: str) -> float:
    value = body.get(name)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise _Refused(400, f"{name} must be {rule}, got {_show(value)}", name)
    return float(value)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat history, checked: objects with a string role and string (or null, or text-part) content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Refused(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _Refused(400, f"messages[{i}] must be an object with a string role", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _Refused(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            m = m | {"content": "".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            raise _Refused(400, f"messages[{i}].content must be a string, got {_show(content)}",
                           f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)):
            raise _Refused(400, f"messages[{i}].tool_calls must be a list of {{function: {{name, arguments}}}}",
                           f"messages[{i}].tool_calls")
        out.append(m)
    return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise _Refused(400, "tools must be a list of objects", "tools")
    return tools


class AgentServer:
    """The endpoint for one rollout: `episode_url(id)` per episode, `serve_until(finished)` on the trainer's
    thread, `close()` after (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, sample: SampleFn, *, eos_token_ids: Sequence[int], max_tokens: int,
                 temperature: float, tool_format: ToolCallFormat | None = None, call_budget: int = 32,
                 max_batch: int = 256, model_name: str = "verl-policy", vocab_size: int | None = None,
                 max_length: int | None = None, max_body_bytes: int = 1 << 20) -> None:
        require_server_libraries()
        self.tokenizer, self.sample, self.eos = tokenizer, sample, list(eos_token_ids)
        self.max_tokens, self.temperature, self.tool_format = max_tokens, temperature, tool_format
        self.call_budget, self.max_batch, self.model_name = call_budget, max_batch, model_name
        # token ids a prompt may hold: the tokenizer's and the model's (its embedding rows), whichever is fewer
        self.vocab_size = min(len(tokenizer), vocab_size or len(tokenizer))
        self.max_length, self.max_body_bytes = max_length, max_body_bytes  # prompt + max_tokens; a request's bytes
        self.episodes: dict[str, EpisodeTokens] = {}
        self._keys: dict[str, str] = {}
        self._turns: dict[str, asyncio.Lock] = {}  # an episode's calls, one at a time: they form one sequence
        self._no_key = secrets.token_urlsafe(24)  # compared against for an unknown episode, so that both take as long
        self.pending: queue.Queue[_Pending] = queue.Queue()
        self.largest_batch = 0  # the most requests sampled together
        self.sampled = 0  # calls the engine sampled
        self.first_error: Exception | None = None  # the first call the engine could not sample
        self._closed = False
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))  # a free port, held from here on (no other process can take it)
        self.port = self._socket.getsockname()[1]
        self._server, self._thread = self._start()

    @property
    def failure(self) -> Exception | None:
        """The engine's error when it sampled no call at all (then not one call's fault: the rollout raises it)."""
        return self.first_error if not self.sampled else None

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> tuple[Any, threading.Thread]:
        import uvicorn

        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=2)
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
        self._closed = True
        while True:  # calls still waiting for a sample: their agents are gone, answer them
            try:
                self._answer(self.pending.get_nowait(), RuntimeError("the rollout has ended"))
            except queue.Empty:
                break
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def episode_url(self, episode_id: str) -> str:
        """The episode's base URL; its key (the path segment after the id) is what admits a call."""
        self.episodes.setdefault(episode_id, EpisodeTokens())
        key = self._keys.setdefault(episode_id, secrets.token_urlsafe(24))
        self._turns.setdefault(episode_id, asyncio.Lock())
        return f"http://127.0.0.1:{self.port}/episodes/{episode_id}/{key}/v1"

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
            for p in sorted(batch, key=lambda p: p.key):  # in one order whatever the order of arrival
                groups.setdefault((p.params.temperature, p.params.top_p, p.params.max_new_tokens), []).append(p)
            for group in groups.values():
                for p, result in zip(group, self._sample_group(group), strict=True):
                    self._answer(p, result)

    def _sample_group(self, group: list[_Pending]) -> list[Sampled | BaseException]:
        """The group's samples. When the batch fails, each call is sampled alone, so that a call the engine
        cannot sample fails that call only (its agent gets the error)."""
        try:
            results = list(self.sample([p.prompt for p in group], group[0].params, [p.key for p in group]))
            if len(results) != len(group):
                raise RuntimeError(f"the sampler returned {len(results)} samples for {len(group)} prompts")
        except Exception as e:  # noqa: BLE001 - an agent's call must not end the rollout
            if len(group) > 1:
                return [r for p in group for r in self._sample_group([p])]
            self.first_error = self.first_error or e
            return [e]
        self.sampled += len(group)
        return results

    @staticmethod
    def _answer(p: _Pending, result: Sampled | BaseException) -> None:
        try:
            p.done(result)
        except RuntimeError:  # the server's event loop is gone (closed): nobody is waiting
            pass

    # ------------------------------------------------------------------ the HTTP side (the server's thread)
    def _app(self) -> Any:
        from starlette.applications import Starlette  # FastAPI's core: one route needs nothing more
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def error(status: int, message: str, param: str | None = None) -> JSONResponse:
            kind = "authentication_error" if status == 401 else "invalid_request_error"
            # 413: the connection closes, so that the rest of the body is not read either
            headers = {"Connection": "close"} if status == 413 else None
            return JSONResponse({"error": {"message": message[:1000], "type": kind, "param": param}},
                                status_code=status, headers=headers)

        async def handle(request: Any) -> Any:
            """Every path: the key is checked before anything else (routing included)."""
            parts = request.url.path.strip("/").split("/")  # episodes / ID / KEY / v1 / ...
            episode_id = parts[1] if len(parts) >= 5 and parts[0] == "episodes" and parts[3] == "v1" else ""
            expected = self._keys.get(episode_id, self._no_key)
            if not episode_id or not hmac.compare_digest(parts[2].encode(errors="replace"), expected.encode()) \
                    or episode_id not in self._keys:
                return error(401, "no episode of this rollout has this key: use the base_url the agent was given")
            route = (request.method, "/".join(parts[4:]))
            if route == ("GET", "models"):
                return JSONResponse({"object": "list", "data": [
                    {"id": self.model_name, "object": "model", "owned_by": "verl"}]})
            if route not in (("POST", "chat/completions"), ("POST", "completions")):
                return error(404, f"no {request.method} /v1/{route[1]} here: POST /v1/chat/completions, "
                                  "POST /v1/completions or GET /v1/models")
            try:
                return JSONResponse(await call(episode_id, request, chat=route[1] == "chat/completions"))
            except _Refused as e:
                return error(e.status, e.message, e.param)

        async def call(episode_id: str, request: Any, chat: bool) -> dict[str, Any]:
            episode = self.episodes[episode_id]
            if self._closed:
                raise _Refused(503, "the rollout has ended")
            if episode.admitted >= self.call_budget:  # no await since the check: concurrent calls count one by one
                episode.refused += 1
                raise _Refused(429, f"the episode's call budget ({self.call_budget} calls) is spent")
            episode.admitted += 1
            try:
                raw = await self._read_body(request)
                async with self._turns[episode_id]:
                    params, prompt = await asyncio.to_thread(self._prepare, episode, raw, chat)
                    result = await self._sample_one(prompt.ids, params, f"{episode_id}/{episode.calls}")
                    completion = self.tokenizer.decode(result.ids, skip_special_tokens=True)
                    if prompt.between is None:
                        episode.begin(prompt.ids)
                    else:
                        episode.extend(prompt.between)
                    episode.last_prompt_text = prompt.text
                    episode.add_sample(prompt.ids, result, completion)
            except _Refused:
                episode.rejected += 1
                raise
            except Exception as e:  # noqa: BLE001 - whatever else went wrong answers this call, nothing more
                episode.rejected += 1
                raise _Refused(500, f"the call failed: {type(e).__name__}: {e}") from None
            return self._response(result, completion, len(prompt.ids), chat)

        return Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])

    async def _read_body(self, request: Any) -> bytes:
        """The request's bytes, refused past `max_body_bytes` before more than that is read."""
        limit, declared = self.max_body_bytes, request.headers.get("content-length")
        too_big = _Refused(413, f"the request body is over the endpoint's limit of {limit} bytes "
                                "(env.agent_max_body_bytes)")
        if declared is not None and (not (declared.isascii() and declared.isdigit()) or int(declared) > limit):
            raise too_big
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
        return bytes(body)

    async def _sample_one(self, prompt: list[int], params: SamplingParams, key: str) -> Sampled:
        """Queue a prompt for the trainer's thread and wait for its sample."""
        if self._closed:
            raise _Refused(503, "the rollout has ended")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(result: Sampled | BaseException) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

        self.pending.put(_Pending(prompt, params, done, key))
        result = await future
        if isinstance(result, BaseException):
            raise _Refused(500, f"sampling failed: {type(result).__name__}: {result}")
        return result

    # ------------------------------------------------------------------ a request, checked (a worker thread)
    def _prepare(self, episode: EpisodeTokens, raw: bytes, chat: bool) -> tuple[SamplingParams, _Prompt]:
        """A request's sampling parameters and prompt, each field checked (parsed and tokenised here, off the
        event loop, so that a big request does not hold up the other episodes)."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise _Refused(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _Refused(400, "the body must be a JSON object")
        params = self._params(body)
        prompt = self._chat_prompt(episode, body) if chat else self._completion_prompt(episode, body)
        field_name = "messages" if chat else "prompt"
        if self.max_length is not None and len(prompt.ids) + params.max_new_tokens > self.max_length:
            too_long = len(prompt.ids) >= self.max_length
            raise _Refused(400, f"the prompt is {len(prompt.ids)} tokens; with max_tokens {params.max_new_tokens} "
                                f"that is over the model's context of {self.max_length} tokens",
                           field_name if too_long else "max_tokens")
        return params, prompt

    def _params(self, body: Mapping[str, Any]) -> SamplingParams:
        if body.get("stream"):
            raise _Refused(400, "stream is not supported: ask without it (the reply comes whole)", "stream")
        n = body.get("n")
        if n is not None and (type(n) is not int or n != 1):
            raise _Refused(400, f"n must be 1: each call is one sample of the episode (got {_show(n)})", "n")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = body.get(name)
        if limit is not None and (type(limit) is not int or limit < 1):
            raise _Refused(400, f"{name} must be a positive integer, got {_show(limit)}", name)
        temperature = _real(body, "temperature", self.temperature, lambda x: x >= 0, "a finite number >= 0")
        top_p = _real(body, "top_p", 1.0, lambda x: 0 < x <= 1, "a number in (0, 1]")
        return SamplingParams(temperature=temperature, top_p=top_p,
                              max_new_tokens=min(limit or self.max_tokens, self.max_tokens),
                              eos_token_ids=self.eos, pad_token_id=self.tokenizer.pad_token_id)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_prompt(self, episode: EpisodeTokens, body: Mapping[str, Any]) -> _Prompt:
        """The prompt ids of a chat call: the episode's sequence continued where the history allows it."""
        messages, tools = _messages(body), _tools(body)
        try:
            text = render_chat(self.tokenizer, messages, tools=tools, add_generation_prompt=True)
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if episode.last_prompt_text is not None and last is not None:
                before = render_chat(self.tokenizer, messages[:last], tools=tools, add_generation_prompt=True)
                through = render_chat(self.tokenizer, messages[: last + 1], tools=tools, add_generation_prompt=False)
                end = turn_end(through, len(before), self.tokenizer.convert_ids_to_tokens(self.eos))
                if before == episode.last_prompt_text and end is not None and text.startswith(through[:end]):
                    # the turn's end-of-turn token: sampled when the turn ended on its own, else added here
                    between = ([] if episode.last_eos else self.eos[:1]) + self._encode(text[end:])
                    return _Prompt(episode.last_ids + between, text, between)
            return _Prompt(self._encode(text), text, None)
        except Exception as e:  # noqa: BLE001 - messages the chat template rejects
            raise _Refused(400, f"the chat template could not render the messages: {type(e).__name__}: {e}",
                           "messages") from None

    def _completion_prompt(self, episode: EpisodeTokens, body: Mapping[str, Any]) -> _Prompt:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids = self._encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = prompt
            if not 0 <= min(ids) <= max(ids) < self.vocab_size:
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise _Refused(400, f"prompt holds token id {bad}, outside the vocabulary [0, {self.vocab_size})",
                               "prompt")
        else:
            raise _Refused(400, "prompt must be a non-empty string or a non-empty list of token ids (one prompt "
                                "per call)", "prompt")
        if episode.calls and ids[: len(episode.last_ids)] == episode.last_ids:
            return _Prompt(ids, "", ids[len(episode.last_ids):])
        return _Prompt(ids, "", None)

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
