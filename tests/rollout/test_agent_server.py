"""The OpenAI-compatible endpoint, called with the real `openai` client: concurrent calls are batched into the
engine, an episode's calls are stitched token for token, and its log-probs equal one forward over them."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tiny_support import load_tiny  # noqa: E402

from tests.rollout.test_multiturn import assert_one_forward_logprobs  # noqa: E402
from verl.data.tool_parsers import tool_call_format  # noqa: E402
from verl.data.tool_template import HERMES_TEMPLATE  # noqa: E402
from verl.rollout import HFKVCacheEngine  # noqa: E402
from verl.rollout.agent_server import AgentServer, Sampled  # noqa: E402
from verl.rollout.multiturn import EpisodeRecord, MultiTurnOutput  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def tiny():
    """The tiny instruct model with the Hermes tool template, in eval mode (tests/tiny_support.py)."""
    return load_tiny(chat_template=HERMES_TEMPLATE, eval_mode=True)


def _server(tiny, **kw):
    model, tok = tiny
    engine = HFKVCacheEngine(model)
    generator = torch.Generator().manual_seed(0)

    def sample(prompts, params, keys):
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = engine.generate(ids, mask, params, generator)
        return [Sampled(out.response_ids[r, :k].tolist(), out.logprobs[r, :k].tolist(), bool(out.finished[r]))
                for r, k in enumerate(out.response_mask.sum(-1).tolist())]

    return AgentServer(tok, sample, eos_token_ids=[tok.eos_token_id], max_tokens=8, temperature=1.0,
                       tool_format=tool_call_format("hermes"), **kw)


def _serve(server, agents):
    """Run the coroutines on a thread of their own while this thread samples; their results."""
    results = []
    worker = threading.Thread(target=lambda: results.extend(asyncio.run(_gather(agents))))
    worker.start()
    server.serve_until(lambda: not worker.is_alive())
    worker.join()
    return results


async def _gather(agents):
    return await asyncio.gather(*agents, return_exceptions=True)


async def _two_calls(url):
    client = openai.AsyncOpenAI(base_url=url, api_key="verl")
    messages = [{"role": "user", "content": "What is 12*3?"}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    reply = first.choices[0].message
    messages += [{"role": "assistant", "content": reply.content or ""},
                 {"role": "tool", "content": "36", "tool_call_id": "call_0"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=5)
    assert second.choices[0].finish_reason in ("stop", "length") and second.usage.completion_tokens <= 5
    return second.choices[0].message.content


def _as_output(server, ids):
    eps = [server.episodes[i] for i in ids]
    width_p, width_r = max(len(e.prompt) for e in eps), max(len(e.response) for e in eps)
    prompt = torch.tensor([[0] * (width_p - len(e.prompt)) + e.prompt for e in eps])
    prompt_mask = torch.tensor([[0] * (width_p - len(e.prompt)) + [1] * len(e.prompt) for e in eps])
    pad = width_r
    response = torch.tensor([e.response + [0] * (pad - len(e.response)) for e in eps])
    attn = torch.tensor([[1] * len(e.response) + [0] * (pad - len(e.response)) for e in eps])
    mask = torch.tensor([e.loss_mask + [0] * (pad - len(e.response)) for e in eps])
    logprobs = torch.tensor([e.logprobs + [0.0] * (pad - len(e.response)) for e in eps])
    records = [EpisodeRecord(row={}, row_index=0, state=None) for _ in eps]
    return MultiTurnOutput(prompt, prompt_mask, response, mask, attn, logprobs, torch.ones(len(eps), dtype=torch.bool),
                           torch.zeros(len(eps)), records)


def test_concurrent_chat_calls_are_batched_and_stitched_token_for_token(tiny):
    server = _server(tiny)
    try:
        ids = [f"e{i}" for i in range(8)]
        results = _serve(server, [_two_calls(server.episode_url(i)) for i in ids])
    finally:
        server.close()
    assert all(isinstance(r, str) for r in results), results
    assert server.largest_batch > 1  # concurrent episodes shared the engine's batch
    for i in ids:
        e = server.episodes[i]
        assert e.calls == 2 and e.restarted == 0
        between = [t for t, m in zip(e.response, e.loss_mask, strict=True) if m == 0]
        text = tiny[1].decode(between)
        assert "<tool_response>\n36\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert_one_forward_logprobs(tiny[0], _as_output(server, ids))


def test_tool_calls_come_back_as_openai_tool_calls_and_bad_requests_as_errors(tiny):
    server = _server(tiny, call_budget=1)
    forced = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    server.sample = lambda prompts, params, keys: [  # a model that always calls the tool
        Sampled(tiny[1](forced, add_special_tokens=False)["input_ids"] + [tiny[1].eos_token_id], [0.0] * 40, True)
        for _ in prompts]

    async def agent(url):
        client = openai.AsyncOpenAI(base_url=url, api_key="verl", max_retries=0)
        reply = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "2*3?"}])
        call = reply.choices[0].message.tool_calls[0]
        assert reply.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "2*3"}')
        with pytest.raises(openai.RateLimitError, match="call budget"):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "again"}])
        return "ok"

    async def wrong(url):
        client = openai.AsyncOpenAI(base_url=url, api_key="verl", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], n=2)
        return "ok"

    try:
        assert _serve(server, [agent(server.episode_url("a")), wrong(server.episode_url("b"))]) == ["ok", "ok"]
    finally:
        server.close()
    assert server.episodes["a"].refused == 1


@pytest.mark.parametrize("ends", [(True, True, True), (False, True, False), (False, False, True)],
                         ids=["eos-eos-eos", "cut-eos-cut", "cut-cut-eos"])
def test_turns_that_ended_on_their_own_or_were_cut_splice_to_the_chat_templates_rendering(tiny, ends):
    """Between two assistant turns there is exactly one end-of-turn token: the one the model sampled when its
    turn ended on its own, the one the endpoint adds when `max_tokens` cut it; the decoded episode is then the
    chat template's rendering of the final history, token for token what a fresh rendering would read."""
    from verl.utils.chat_render import render_chat

    _, tok = tiny
    eos = tok.eos_token_id
    words = ["first answer", "second", "third try"]
    replies = [tok(w, add_special_tokens=False)["input_ids"] + ([eos] if e else [])
               for w, e in zip(words, ends, strict=True)]
    server = _server(tiny)
    calls = iter(range(len(replies)))
    server.sample = lambda prompts, params, keys: [
        Sampled(r, [-0.5] * len(r), r[-1] == eos) for r in (replies[next(calls)] for _ in prompts)]

    async def agent(url):
        client = openai.AsyncOpenAI(base_url=url, api_key="verl", max_retries=0)
        messages = [{"role": "user", "content": "Say something."}]
        for turn in range(len(replies)):
            reply = await client.chat.completions.create(model="p", messages=messages)
            assert reply.choices[0].finish_reason == ("stop" if ends[turn] else "length")
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            if turn < len(replies) - 1:
                messages += [{"role": "user", "content": f"And {turn}?"}]
        return messages

    try:
        [history] = _serve(server, [agent(server.episode_url("a"))])
    finally:
        server.close()
    e = server.episodes["a"]
    assert (e.calls, e.restarted) == (3, 0)
    sequence = e.prompt + e.response
    assert sequence.count(eos) == len(history) - 1 + ends[-1]  # one per turn, the last one only when sampled
    rendered = render_chat(tok, history, tools=None, add_generation_prompt=False)
    decoded = tok.decode(sequence)
    if ends[-1]:  # the template closes the last turn too, with the newline that follows its end-of-turn token
        assert rendered.startswith(decoded) and rendered[len(decoded):] == "\n"
    else:
        assert decoded == rendered[: rendered.rindex(tok.eos_token)]
    # token for token the template's rendering: every turn's ids are what its text encodes to
    assert sequence == tok(decoded, add_special_tokens=False)["input_ids"]
    assert [t for t, m in zip(e.response, e.loss_mask, strict=True) if m] == [t for r in replies for t in r]
