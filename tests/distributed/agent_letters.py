"""Agent code for the asynchronous tests (env.agent: agent_letters.py:run): plain OpenAI-client code that makes
two chat calls per episode, the second after a user turn about the first reply. Some episodes fail (the agent
raises: masked out, its traceback in the episode's text), some leave the reward to the environment (None), the
rest return one of their own (the second reply's length: dense and varied within a group)."""

import asyncio

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

_HTTP = {}  # one HTTP client per event loop, shared by its episodes


def http_client():
    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        _HTTP.clear()
        _HTTP[loop] = DefaultAsyncHttpxClient()
    return _HTTP[loop]


async def ask(client, messages):
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return reply.choices[0].message.content or ""


async def run(row, base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="verl", max_retries=0, http_client=http_client())
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await ask(client, messages)
    if str(row["ground_truth"]).endswith(("3", "7")):
        raise RuntimeError(f"the agent gives up on {row['prompt']!r}")
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": f"{len(first)} characters."}]
    second = await ask(client, messages)
    if str(row["ground_truth"]).endswith(("1", "5")):
        return None  # the environment's reward over the last reply
    return len(second) % 4 / 3
