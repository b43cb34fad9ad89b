"""`env.agent`: agent code calls the policy through the OpenAI endpoint; its episodes train like any others, an
agent that raises or runs out of time fails its episode only, and a bad agent spec is refused at start-up."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from tests.trainer.rl_support import rl_config  # noqa: E402
from verl.errors import ConfigError  # noqa: E402
from verl.rollout.agent_episodes import agent_problems  # noqa: E402
from verl.trainer.rl_trainer import RLTrainer  # noqa: E402

AGENT = '''
import asyncio
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

HTTP = {}
SLEEP = {"s": 120.0}  # set to 0 by the test for its cold first step


async def run(row, base_url):
    loop = asyncio.get_running_loop()
    http = HTTP.setdefault(loop, DefaultAsyncHttpxClient())  # one per rollout: a new one loads the certificates
    client = AsyncOpenAI(base_url=base_url, api_key="verl", max_retries=0, http_client=http)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    if row["prompt"].startswith("1"):
        raise RuntimeError("the agent broke on " + row["prompt"])
    if row["prompt"].startswith("2"):
        await asyncio.sleep(SLEEP["s"])
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(any(c.isdigit() for c in second.choices[0].message.content))


async def two_calls(row, base_url):
    loop = asyncio.get_running_loop()
    http = HTTP.setdefault(loop, DefaultAsyncHttpxClient())
    client = AsyncOpenAI(base_url=base_url, api_key="verl", max_retries=0, http_client=http)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Sure?"}]
    return float(any(c.isdigit() for c in reply.choices[0].message.content))


def not_async(row, base_url):
    return 0.0


async def one_argument(row):
    return 0.0


POSTER = """
import json, sys, urllib.request, urllib.error
for url in sys.argv[1:]:
    body = {"model": "p", "prompt": "INJECTED", "messages": [{"role": "user", "content": "INJECTED"}]}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        print(urllib.request.urlopen(request, timeout=30).status)
    except urllib.error.HTTPError as e:
        print(e.code)
"""
STATUSES = []


async def hostile(row, base_url):
    """Another local process posts into this episode and others with guessed URLs; this agent sends bad calls."""
    import sys
    from openai import BadRequestError

    root, rest = base_url.split("/episodes/")
    episode = rest.split("/")[0]
    guesses = [f"{root}/episodes/{e}/v1/chat/completions" for e in (episode, "0-0", "1-1")]
    guesses += [f"{root}/episodes/{episode}/guess/v1/completions", f"{root}/v1/completions"]
    poster = await asyncio.create_subprocess_exec(sys.executable, "-c", POSTER, *guesses,
                                                  stdout=asyncio.subprocess.PIPE)
    STATUSES.extend((await poster.communicate())[0].decode().split())
    loop = asyncio.get_running_loop()
    http = HTTP.setdefault(loop, DefaultAsyncHttpxClient())
    client = AsyncOpenAI(base_url=base_url, api_key="verl", max_retries=0, http_client=http)
    for bad in ({"prompt": [999999]}, {"prompt": [5, -1]}, {"prompt": "x", "temperature": "nan"},
                {"prompt": "x", "n": "abc"}, {"prompt": "x " * 100_000}):
        try:
            await client.completions.create(model="p", **bad)
        except BadRequestError:
            STATUSES.append("400")
    reply = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}])
    return float(any(c.isdigit() for c in reply.choices[0].message.content))
'''


def _config(tmp_path, agent="agent.py:run", *more):
    (tmp_path / "agent.py").write_text(AGENT)
    return rl_config(tmp_path / "run", f"env.agent={tmp_path / agent}", "env.agent_timeout_s=120",
                     "env.kwargs.max_operand=29", "data.train_batch_size=8", "rollout.max_new_tokens=6", *more,
                     reward=None)


def test_agent_episodes_train_and_failures_stay_in_their_episode(tmp_path):
    trainer = RLTrainer(_config(tmp_path, "agent.py:run", "logging.rollout_samples=1000"))  # trace every row
    sleep = trainer.multiturn.agent.__globals__["SLEEP"]
    sleep["s"] = 0.0  # the cold step (first calls import the client's types): no episode sleeps, none times out
    metrics = trainer.step()
    assert metrics["episode/agent_timeout"] == 0.0
    assert metrics["episode/agent_calls"] > 1  # two calls per healthy episode, one for the raising ones
    assert metrics["episode/agent_restarted_calls"] == 0.0  # each continued its episode's sequence
    # the step's rollouts for `verl view`: a raising agent's episode is "failed" with its traceback, the others ok
    traced = trainer.trace.rows["rollouts.jsonl"]
    assert all(r["episode"] is not None for r in traced)
    broken = [r for r in traced if r["prompt"].startswith("1")]
    assert broken and all(r["episode"]["status"] == "failed" and "RuntimeError: the agent broke on 1"
                          in r["episode"]["error"] for r in broken)
    assert {r["episode"]["status"] for r in traced if not r["prompt"].startswith("1")} == {"ok"}
    sleep["s"], trainer.config.env.agent_timeout_s = 120.0, 15.0  # now warm: the sleepers time out
    batch = trainer.multiturn.run(trainer.env.val_rows()[:8], 4, trainer.sampling, trainer.generator)
    failed = [e for e in batch.episodes if e.row["prompt"].startswith("1")]
    sleeping = [e for e in batch.episodes if e.row["prompt"].startswith("2")]
    assert failed and sleeping
    for e in failed:  # not trained on, reward 0, the traceback in its sample
        assert e.info["agent_failed"] and not any(e.loss_mask) and e.reward == 0.0
    for e in sleeping:  # trained on what it wrote, reward 0
        assert e.info["agent_timeout"] and e.reward == 0.0 and any(e.loss_mask)
    texts = trainer.multiturn.texts(batch)
    assert all("RuntimeError: the agent broke on 1" in texts[batch.episodes.index(e)] for e in failed)
    healthy = [e for e in batch.episodes if e.finished]  # (a loaded machine may time some of the others out)
    assert healthy and all(e.turns == 2 and e.reward in (0.0, 1.0) for e in healthy)


def test_what_an_episode_samples_does_not_depend_on_which_calls_share_its_batch(tmp_path):
    """Concurrent agents' calls batch by arrival time; each call samples with uniform numbers of its own key (its
    episode, its call number), so one agent at a time and 32 at once sample the same episodes, and another seed
    others."""
    trainer = RLTrainer(_config(tmp_path, "agent.py:two_calls"))
    rows = trainer.env.val_rows()[:8]

    def rollout(concurrency, seed):
        trainer.config.env.agent_concurrency = concurrency
        server_batches = []
        out = trainer.multiturn.run(rows, 4, trainer.sampling, torch.Generator().manual_seed(seed))
        server_batches.append(out)
        return [(e.row["prompt"], e.tokens, e.reward) for e in out.episodes]

    one_at_a_time = rollout(1, 7)
    assert one_at_a_time == rollout(32, 7)
    assert one_at_a_time != rollout(32, 8)
    assert all(len(tokens) > 0 for _, tokens, _ in one_at_a_time)


@pytest.mark.parametrize("agent, says", [
    ("missing.py:run", "agent file"),
    ("agent.py:nothing",
     "has no function 'nothing' (its async functions: ['run', 'two_calls', 'one_argument', 'hostile'])"),
    ("agent.py:not_async", "must be an async function"),
    ("agent.py:one_argument", "must take (row, base_url)"),
])
def test_a_bad_agent_is_refused_at_start_up(tmp_path, agent, says):
    problems = agent_problems(_config(tmp_path, agent))
    assert any(says in str(p) for p in problems), problems
    with pytest.raises(ConfigError, match="env.agent="):
        RLTrainer(_config(tmp_path, agent))


def test_another_process_posting_into_a_run_is_refused_and_never_trained_on(tmp_path):
    """The trial's attack during `verl train`: another local process posts to the endpoint with guessed episode
    ids, and the agents themselves send calls that once ended the run; the run trains on its episodes' own calls."""
    trainer = RLTrainer(_config(tmp_path, "agent.py:hostile", "env.agent_call_budget=8"))
    statuses = trainer.multiturn.agent.__globals__["STATUSES"]
    for _ in range(2):
        trainer.step()  # runs to the end of each step
    batch = trainer.multiturn.run(trainer.env.val_rows()[:4], 2, trainer.sampling, trainer.generator)
    assert statuses.count("401") == statuses.count("400") >= 5 * 8  # five of each from every episode
    assert set(statuses) == {"400", "401"}
    assert not any(e.info["agent_failed"] for e in batch.episodes)
    assert all(e.info["agent_calls"] == 1 and e.info["agent_rejected_calls"] == 5 for e in batch.episodes)
    assert not any("INJECTED" in text for text in trainer.multiturn.texts(batch))


OWN_REWARD = '''
from openai import AsyncOpenAI


async def scores(row, base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="verl", max_retries=0)
    reply = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}])
    return float(any(c.isdigit() for c in reply.choices[0].message.content or ""))


async def leaves_it(row, base_url):
    await scores(row, base_url)
    return None
'''


def _own_reward_config(tmp_path, agent):
    from tiny_support import tiny_run_config

    (tmp_path / "agent.py").write_text(OWN_REWARD)
    rows = "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(8))
    (tmp_path / "rows.jsonl").write_text(rows)
    return tiny_run_config(tmp_path / "run", f"data.train_files=[{tmp_path / 'rows.jsonl'}]", "data.train_batch_size=2",
                           "rollout.n=2", "rollout.max_new_tokens=3", f"env.agent={tmp_path / 'agent.py'}:{agent}")


def test_an_agent_that_returns_its_own_rewards_needs_no_reward_functions(tmp_path):
    """Prompts from data files, rewards from the agent: no reward.functions needed (it was refused as 'every
    sample would score 0'); an agent that then returns None is told there is nothing to score with."""
    from verl.errors import RewardError

    trainer = RLTrainer(_own_reward_config(tmp_path, "scores"))
    assert "reward/mean" in trainer.step()
    trainer = RLTrainer(_own_reward_config(tmp_path, "leaves_it"))
    with pytest.raises(RewardError, match="return a number from the agent, or set reward.functions"):
        trainer.step()
