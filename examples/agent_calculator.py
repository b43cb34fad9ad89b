"""The agent of examples/agent_tools.yaml: plain OpenAI-client code, trained unchanged through the trainer's
endpoint. It offers the model a calculator tool, runs the calls the model makes, and rewards an answer equal
to the product; a wrong answer earns PARTIAL_CREDIT times the share of the product's digits it has in place
(as the tool demo's `partial_credit`): a signal before the first right answers, for the operands copied into the
call and for the result copied into the answer alike."""

import asyncio
import json

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from verl.env.calculator import digit_overlap, evaluate_expression
from verl.rewards.builtin import extract_number

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Multiply integers: a*b.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_CALLS = 2
PARTIAL_CREDIT = 0.5
_HTTP = {}  # one HTTP client per event loop, shared by its episodes: a new one loads the certificates


def http_client():
    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        _HTTP.clear()  # the previous rollout's loop is closed
        _HTTP[loop] = DefaultAsyncHttpxClient()
    return _HTTP[loop]


def calculate(arguments: str) -> str:
    try:
        value = evaluate_expression(str(json.loads(arguments).get("expression", "")))
    except (json.JSONDecodeError, AttributeError):
        value = None
    return "error" if value is None else str(value)


async def run(row, base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="verl", max_retries=0, http_client=http_client())
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_CALLS + 1):
        message = (
            await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        ).choices[0].message
        if not message.tool_calls:
            answer, product = extract_number(message.content or ""), int(row["ground_truth"])
            return 1.0 if answer == product else PARTIAL_CREDIT * digit_overlap(answer, product)
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [call.model_dump() for call in message.tool_calls]})
        messages += [{"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)}
                     for call in message.tool_calls]
    return 0.0  # still calling tools after MAX_CALLS
