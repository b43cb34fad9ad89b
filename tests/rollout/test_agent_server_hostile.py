"""The agent endpoint against hostile callers: any local process can reach its port, and the agent code itself
may send anything. A call without its episode's key is refused and touches nothing; every bad field is a 400
naming it; a big body is refused before it is read; the call budget holds under concurrency; a big request
does not hold up other episodes; a call the engine cannot sample fails only itself."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")

from transformers import AutoTokenizer  # noqa: E402

from verl.data.tool_template import HERMES_TEMPLATE  # noqa: E402
from verl.models.tiny import build_tiny_model  # noqa: E402
from verl.rollout.agent_server import AgentServer, EpisodeTokens, Sampled  # noqa: E402

CONTEXT = 1024  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def tok():
    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    tok.chat_template = HERMES_TEMPLATE
    return tok


@contextlib.contextmanager
def serving(tok, sample=None, running=None, **kw):
    """An endpoint whose requests a thread of its own samples (by default: "ok" and eos, for every prompt)."""
    reply = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    sample = sample or (lambda prompts, params, keys: [Sampled(reply, [0.0] * len(reply), True) for _ in prompts])
    server = AgentServer(tok, sample, eos_token_ids=[tok.eos_token_id], max_tokens=8, temperature=1.0,
                         max_length=CONTEXT, vocab_size=len(tok), **kw)
    stop = threading.Event()
    sampler = threading.Thread(target=server.serve_until, args=(stop.is_set, running), daemon=True)
    sampler.start()
    try:
        yield server
    finally:
        stop.set()
        sampler.join(timeout=10)
        server.close()


def post(url, body, timeout=30.0):
    """(status, JSON answer) of a POST with a JSON (or raw bytes) body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def chat(text="hi", **fields):
    return {"model": "p", "messages": [{"role": "user", "content": text}], **fields}


def untouched(e: EpisodeTokens) -> bool:
    return e.calls == 0 and not e.prompt and not e.response


# ---------------------------------------------------------------------------------------------- the key
def test_every_episode_has_an_unguessable_key_in_its_base_url(tok):
    with serving(tok) as server:
        a, b = server.episode_url("0-0"), server.episode_url("0-1")
        assert a == server.episode_url("0-0")  # one key per episode
        key_a, key_b = a.split("/")[-2], b.split("/")[-2]
        assert key_a != key_b and len(key_a) >= 32
        assert post(a + "/chat/completions", chat())[0] == 200


@pytest.mark.parametrize("path", [
    "/episodes/e0/v1/chat/completions",  # the id alone (the old URL)
    "/episodes/e0/not-the-key/v1/chat/completions",
    "/episodes/e0/{other}/v1/chat/completions",  # another episode's key
    "/episodes/nope/{key}/v1/chat/completions",
    "/episodes/e0/{key}x/v1/chat/completions",
    "/episodes/e0/%C3%A9/v1/completions",
    "/v1/chat/completions",
    "/docs",
    "/openapi.json",
])
def test_a_call_without_the_episode_key_gets_401_and_touches_nothing(tok, path):
    with serving(tok) as server:
        url = server.episode_url("e0")
        key, other = url.split("/")[-2], server.episode_url("e1").split("/")[-2]
        status, answer = post(f"http://127.0.0.1:{server.port}" + path.format(key=key, other=other),
                              chat("INJECTED", n=2))
        assert status == 401 and answer["error"]["type"] == "authentication_error", answer
        assert all(untouched(e) and e.admitted == 0 for e in server.episodes.values())
        assert server.sampled == 0


HOSTILE = """
import json, sys, urllib.request, urllib.error
for url in sys.argv[1:]:
    body = json.dumps({"model": "p", "prompt": [7, 7, 7], "messages": [{"role": "user", "content": "INJECTED"}]})
    request = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
    try:
        print(urllib.request.urlopen(request, timeout=30).status)
    except urllib.error.HTTPError as e:
        print(e.code)
"""


def test_another_process_cannot_post_into_a_serving_episode(tok):
    """The trial's attack: during a rollout another process posts to the port with a guessed episode id."""
    with serving(tok) as server:
        url = server.episode_url("0-0")
        base = f"http://127.0.0.1:{server.port}/episodes/0-0"
        assert post(url + "/chat/completions", chat("What is 2+3?"))[0] == 200
        guesses = [f"{base}/v1/chat/completions", f"{base}/v1/completions", f"{base}/guess/v1/chat/completions"]
        hostile = subprocess.run([sys.executable, "-c", HOSTILE, *guesses], capture_output=True, text=True,
                                 timeout=60)
        assert hostile.stdout.split() == ["401"] * 3, hostile.stdout + hostile.stderr
        assert post(url + "/chat/completions", chat("What is 2+3?"))[0] == 200  # the agent carries on
    e = server.episodes["0-0"]
    assert e.calls == 2 and e.admitted == 2
    assert "INJECTED" not in tok.decode(e.prompt + e.response) and [7, 7, 7] != e.prompt[:3]


# ---------------------------------------------------------------------------------------------- fields
BAD = [
    ("completions", {"prompt": [999999]}, "prompt"),  # outside the vocabulary: ended the run
    ("completions", {"prompt": [5, -1]}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),  # a batch of prompts
    ("completions", {"prompt": [1.5]}, "prompt"),
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": 12}, "prompt"),
    ("completions", {"prompt": [5] * 1020, "max_tokens": 8}, "max_tokens"),  # prompt + max_tokens over the context
    ("chat/completions", chat(temperature="nan"), "temperature"),
    ("chat/completions", chat(temperature=float("nan")), "temperature"),  # a JSON NaN
    ("chat/completions", chat(temperature=float("inf")), "temperature"),
    ("chat/completions", chat(temperature=-1), "temperature"),
    ("chat/completions", chat(temperature=True), "temperature"),
    ("chat/completions", chat(top_p=0), "top_p"),
    ("chat/completions", chat(top_p=1.5), "top_p"),
    ("chat/completions", chat(n="abc"), "n"),  # was a 500 with a traceback
    ("chat/completions", chat(n=2), "n"),
    ("chat/completions", chat(max_tokens=0), "max_tokens"),  # was silently the default
    ("chat/completions", chat(max_tokens=-3), "max_tokens"),
    ("chat/completions", chat(max_tokens="5"), "max_tokens"),
    ("chat/completions", chat(max_completion_tokens=0), "max_completion_tokens"),
    ("chat/completions", chat(stream=True), "stream"),  # was silently a whole reply
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {}, "messages"),
    ("chat/completions", {"messages": ["hi"]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": 3, "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": None, "tool_calls": "x"}]},
     "messages[1].tool_calls"),
    ("chat/completions", chat(tools="calculator"), "tools"),
    ("chat/completions", chat("word " * 40_000), "messages"),  # 200k characters: over the context
]


def test_each_bad_field_is_a_400_naming_it_and_touches_nothing(tok):
    with serving(tok, call_budget=1) as server:
        for i, (route, body, param) in enumerate(BAD):
            url = server.episode_url(f"bad{i}")
            status, answer = post(f"{url}/{route}", body)
            assert (status, (answer or {}).get("error", {}).get("param")) == (400, param), (body, answer)
            assert answer["error"]["type"] == "invalid_request_error"
            assert untouched(server.episodes[f"bad{i}"]) and server.episodes[f"bad{i}"].rejected == 1
        for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000):
            url = server.episode_url(f"raw{len(raw)}")
            status, answer = post(url + "/chat/completions", raw)
            assert status == 400 and "JSON" in answer["error"]["message"], answer
        assert server.sampled == 0
        ok = server.episode_url("fine")
        # text content parts are fine, and so is a call that fits
        assert post(ok + "/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}]}]})[0] == 200


# ---------------------------------------------------------------------------------------------- size
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's RSS from /proc")
def test_an_oversized_body_is_refused_before_it_is_read(tok):
    with serving(tok) as server:
        url = server.episode_url("big")
        path = url.split(str(server.port), 1)[1] + "/chat/completions"
        # a declared 50 MB: refused at once, from the header, before a byte of the body
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {50 * 2**20}\r\n\r\n".encode())
            assert s.recv(4096).split(b"\r\n")[0].startswith(b"HTTP/1.1 413 ")
        # 50 MB streamed without a length: the server stops reading past its limit, its memory stays put
        peak, sent, stop = [_rss_mb()], [0], threading.Event()
        before = peak[0]

        def watch():
            while not stop.is_set():
                peak.append(_rss_mb())
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        chunk = b"a" * 2**16
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Transfer-Encoding: chunked\r\n\r\n".encode())
                s.sendall(b'11\r\n{"messages": "aaa\r\n')
                while sent[0] < 50 * 2**20:
                    s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    sent[0] += len(chunk)
        except OSError:  # the server closed the connection: what we wanted
            pass
        finally:
            stop.set()
            watcher.join()
        assert sent[0] < 20 * 2**20, f"the server read {sent[0]} bytes"
        assert max(peak) - before < 40, f"RSS grew {max(peak) - before:.0f} MB"
        assert untouched(server.episodes["big"])
        assert post(url + "/chat/completions", chat())[0] == 200  # and still serves


# ---------------------------------------------------------------------------------------------- budget
def test_the_call_budget_holds_under_concurrent_calls(tok):
    reply = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def slow(prompts, params, keys):
        time.sleep(0.05)  # the calls overlap
        return [Sampled(reply, [0.0] * len(reply), True) for _ in prompts]

    with serving(tok, slow, call_budget=4) as server:
        url = server.episode_url("0-0") + "/chat/completions"
        with ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(lambda _: post(url, chat()), range(40)))
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200] * 4 + [429] * 36
    assert all("call budget (4 calls)" in a["error"]["message"] for s, a in answers if s == 429)
    e = server.episodes["0-0"]
    assert (e.calls, e.admitted, e.refused) == (4, 4, 36)


# ---------------------------------------------------------------------------------------------- the event loop
def test_a_big_message_does_not_hold_up_another_episode(tok):
    """Parsing and tokenising run off the event loop: another episode's call is answered meanwhile."""
    rng = random.Random(0)
    big = " ".join("".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(135_000))  # 945 kB
    with serving(tok) as server:
        a, b = server.episode_url("a"), server.episode_url("b")
        post(b + "/chat/completions", chat())  # warm
        done = {}

        def call(name, url, text):
            start = time.monotonic()
            done[name] = (post(url + "/chat/completions", chat(text))[0], start, time.monotonic())

        big_call = threading.Thread(target=call, args=("a", a, big))
        big_call.start()
        time.sleep(0.1)
        call("b", b, "hi")
        big_call.join()
    assert done["a"][0] == 400 and done["b"][0] == 200  # the big one is over the model's context
    assert done["b"][2] + 0.2 < done["a"][2], done  # b was answered while a was still being tokenised


# ---------------------------------------------------------------------------------------------- failures
def test_a_call_the_engine_cannot_sample_fails_only_itself(tok):
    reply = [5, tok.eos_token_id]

    def sample(prompts, params, keys):
        if any(p[0] == 13 for p in prompts):  # a prompt this "engine" cannot sample
            raise ValueError("cannot sample this prompt")
        return [Sampled(reply, [0.0, 0.0], True) for _ in prompts]

    with serving(tok, sample, running=lambda: 2) as server:  # the two calls share a batch
        a, b = server.episode_url("a"), server.episode_url("b")
        with ThreadPoolExecutor(2) as pool:
            bad, good = pool.map(lambda args: post(*args), [(a + "/completions", {"prompt": [13, 14]}),
                                                            (b + "/completions", {"prompt": [15, 16]})])
    assert bad[0] == 500 and "cannot sample this prompt" in bad[1]["error"]["message"]
    assert good[0] == 200 and good[1]["usage"]["completion_tokens"] == 2
    assert server.failure is None  # the rollout goes on; the failed call is its episode's alone
    assert untouched(server.episodes["a"]) and server.episodes["b"].calls == 1

    def broken(prompts, params, keys):
        raise RuntimeError("the engine is broken")

    with serving(tok, broken) as server:  # an engine that samples nothing: the rollout raises it
        assert post(server.episode_url("a") + "/completions", {"prompt": [13]})[0] == 500
    assert isinstance(server.failure, RuntimeError)
