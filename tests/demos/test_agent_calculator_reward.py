"""The agent demo's reward (examples/agent_calculator.py): 1 for the product, else PARTIAL_CREDIT times the share
of the product's digits the answer has in place; 0 for an episode still calling tools after MAX_CALLS."""

import asyncio
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[2]


def _agent():
    path = ROOT / "examples" / "agent_calculator.py"
    spec = importlib.util.spec_from_file_location("agent_calculator_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(expression):
    function = SimpleNamespace(name="calculator", arguments=json.dumps({"expression": expression}))
    return SimpleNamespace(id="c1", function=function, model_dump=lambda: {"id": "c1", "type": "function"})


def _reward(replies, monkeypatch, product="10063"):
    """The agent's reward when the policy replies `replies` in turn (a str: an answer; a list: tool calls)."""
    module = _agent()
    replies = iter(replies)

    class Completions:
        async def create(self, **_):
            reply = next(replies)
            message = (SimpleNamespace(content=reply, tool_calls=None) if isinstance(reply, str)
                       else SimpleNamespace(content=None, tool_calls=[_call(e) for e in reply]))
            return SimpleNamespace(choices=[SimpleNamespace(message=message)])

    client = SimpleNamespace(chat=SimpleNamespace(completions=Completions()))
    monkeypatch.setattr(module, "AsyncOpenAI", lambda **_: client)
    monkeypatch.setattr(module, "http_client", lambda: None)
    return asyncio.run(module.run({"prompt": "347*29=", "ground_truth": product}, "http://unused"))


@pytest.mark.parametrize(("replies", "want"), [
    ([["347*29"], "10063"], 1.0),                      # the call, then the product
    (["10063"], 1.0),                                   # the product without a call still counts
    ([["347*29"], "10073"], 0.5 * 4 / 5),               # right call, one digit miscopied: 4 of 5 in place
    ([["348*29"], "10092"], 0.5 * 3 / 5),               # miscopied operand: the product of another call
    ([["347*29"], "1006"], 0.5 * 4 / 5),                # a digit dropped: 4 in place over 5
    ([["347*29"], "100630"], 0.5 * 5 / 6),              # a digit added: over the longer of the two
    ([["347*29"], "no idea"], 0.0),                     # no number
    ([["347*29"], "10063 or 5"], 0.0),                  # the last number is the answer
    ([["347*29"], ["347*29"], ["347*29"]], 0.0),        # still calling after MAX_CALLS: nothing
    ([["three hundred"], "36063"], 0.5 * 3 / 5),        # the calculator said "error"; the answer is still scored
])
def test_an_answer_earns_one_or_partial_credit_for_the_digits_in_place(replies, want, monkeypatch):
    assert _reward(replies, monkeypatch) == pytest.approx(want, abs=1e-12)
