"""`remote`: a reward server in OpenRLHF's protocol, here a local HTTP server in a thread."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from verl.errors import RewardError
from verl.rewards import RewardManager


class Server:
    """Answers POSTs with `self.answer(body) -> (status, payload)`; records every body it got."""

    def __init__(self, answer):
        self.answer, self.bodies = answer, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append((self.path, body))
                status, payload = outer.answer(body)
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    made = []

    def start(answer):
        made.append(Server(answer))
        return made[-1]

    yield start
    for s in made:
        s.close()


def remote(url, **kwargs):
    return RewardManager([{"name": "remote", "kwargs": {"url": url, "retries": 0, "timeout_s": 5, **kwargs}}])


def test_one_post_per_batch_in_openrlhfs_protocol(server):
    s = server(lambda body: (200, {"rewards": [len(r) / 10 for r in body["responses"]]}))
    result = remote(s.url).score(["2+2=", [{"role": "user", "content": "3+3?"}]], ["4", "six"], ["4", "6"])
    assert result.scores.tolist() == pytest.approx([0.1, 0.3])
    assert len(s.bodies) == 1  # the whole batch in one request
    path, body = s.bodies[0]
    assert path == "/get_reward" and body["query"] == ["2+2=4", "3+3?\nsix"] and body["labels"] == ["4", "6"]
    assert body["prompts"][1] == [{"role": "user", "content": "3+3?"}]


def test_a_server_error_is_retried_then_succeeds(server):
    replies = iter([(503, {"error": "warming up"}), (200, {"scores": [1.0]})])
    s = server(lambda body: next(replies))
    result = remote(s.url, retries=1, score_key="scores").score(["q"], ["a"], ["a"])
    assert result.scores.tolist() == [1.0] and len(s.bodies) == 2


@pytest.mark.parametrize("answer, message", [
    ((404, {"detail": "Not Found"}), "refused the request: HTTP 404.*the path too"),
    ((200, {"score": [1.0]}), "answered without 'rewards' \\(got \\['score'\\]\\).*kwargs.score_key"),
    ((200, "<html>oops</html>"), "not JSON"),
    ((500, {"error": "boom"}), "did not answer after 1 tries \\(last: HTTP 500"),
    ((200, {"rewards": [1.0, 2.0]}), "returned 2 results for 1 samples"),
])
def test_what_goes_wrong_is_named_with_the_url(server, answer, message):
    s = server(lambda body: answer)
    with pytest.raises(RewardError, match=message) as info:
        remote(s.url).score(["q"], ["a"], ["a"])
    assert "remote" in str(info.value)


def test_an_unreachable_server_and_bad_kwargs_fail_clearly():
    with pytest.raises(RewardError, match="127.0.0.1:9/x did not answer after 1 tries.*start the server"):
        remote("http://127.0.0.1:9/x").score(["q"], ["a"], ["a"])
    for url in ("rm-host:5000", "http://rm-host:port/get_reward", "http:///get_reward"):
        with pytest.raises(RewardError, match="kwargs.url must be the reward server's http\\(s\\) URL"):
            RewardManager([{"name": "remote", "kwargs": {"url": url}}])
    with pytest.raises(RewardError, match="unknown kwargs \\['timeout'\\]"):
        RewardManager([{"name": "remote", "kwargs": {"url": "http://h/x", "timeout": 3}}])


def test_rl_trains_on_a_remote_reward(server, tmp_path):
    from verl.config import load_config
    from verl.trainer.rl_trainer import RLTrainer

    s = server(lambda body: (200, {"rewards": [float(r[:1].isdigit()) for r in body["responses"]]}))
    config = load_config(overrides=["model.path=tiny", "trainer.device=cpu", f"trainer.run_dir={tmp_path}",
                                    "trainer.total_steps=2", "trainer.val_before_train=false",
                                    "data.train_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=3",
                                    "logging.backends=[jsonl]",
                                    f"reward.functions=[{{name: remote, kwargs: {{url: '{s.url}'}}}}]"])
    history = RLTrainer(config, rows=[{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(4)]).fit()
    assert len(history) == 2 and "reward/remote/score" in history[0] and len(s.bodies) == 2
    assert all(len(body["query"]) == 4 for _, body in s.bodies)  # 2 prompts x 2 samples per request
