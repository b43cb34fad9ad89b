"""`remote`: rewards from an HTTP server, in OpenRLHF's remote reward-model protocol.

For a reward model too big to sit beside the policy (served on machines of its own), or a sandbox that
runs code: one POST per batch to `kwargs.url` with the JSON body
    {"query": [prompt + response, ...], "prompts": [...], "responses": [...], "labels": [ground truth, ...]}
whose reply is JSON holding one number per sample under `kwargs.score_key` (default "rewards"), as
OpenRLHF's `serve_rm` answers. A chat prompt goes as its messages in `prompts`; its `query` joins their
contents and the response with newlines (the server cannot know the policy's chat template).

Connection errors, timeouts and 5xx replies are retried (`kwargs.retries`, default 3, with back-off); a
4xx reply, a reply that is not JSON or lacks the key, or the server still failing stops the run with the
URL and what came back. Standard library only (urllib).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

from verl.errors import RewardError


def _query(prompt: Any, response: str) -> str:
    if isinstance(prompt, str):
        return prompt + response
    messages = prompt if isinstance(prompt, list) else [prompt]
    contents = [m.get("content", "") if isinstance(m, Mapping) else m for m in messages]
    return "\n".join([*map(str, contents), response])


def _post(url: str, body: bytes, timeout_s: float) -> Any:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:  # noqa: S310 - the user's own http(s) URL
        text = reply.read().decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RewardError(f"the reward server at {url} answered with something that is not JSON: {text[:200]!r}. "
                          "Fix: the server must reply with a JSON object such as {\"rewards\": [0.5, ...]}") from None


def remote_reward(prompts: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any],
                  metadata: Sequence[Any], *, url: str, score_key: str = "rewards", timeout_s: float = 60.0,
                  retries: int = 3) -> list[Any]:
    """One score per sample from the server at `url` (see the module docstring)."""
    body = json.dumps({"query": [_query(p, r) for p, r in zip(prompts, responses, strict=True)],
                       "prompts": list(prompts), "responses": list(responses), "labels": list(ground_truths)},
                      default=str).encode("utf-8")
    failure = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(2.0 ** (attempt - 1), 10.0))
        try:
            payload = _post(url, body, timeout_s)
            break
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", errors="replace")[:200]
            if e.code < 500:
                raise RewardError(f"the reward server at {url} refused the request: HTTP {e.code} {e.reason} "
                                  f"{detail!r}. Fix: check kwargs.url (the path too, e.g. /get_reward) and that the "
                                  "server takes {\"query\": [...]} bodies") from None
            failure = f"HTTP {e.code} {e.reason} {detail!r}"
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            failure = str(getattr(e, "reason", e))
    else:
        raise RewardError(f"the reward server at {url} did not answer after {retries + 1} tries (last: {failure}). "
                          "Fix: start the server, correct kwargs.url, or raise kwargs.timeout_s / kwargs.retries")
    if not isinstance(payload, Mapping) or score_key not in payload:
        keys = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
        raise RewardError(f"the reward server at {url} answered without {score_key!r} (got {keys}). Fix: set "
                          "kwargs.score_key to the key that holds one score per sample")
    return payload[score_key]


def check_remote_kwargs(kwargs: dict[str, Any]) -> None:
    """At start-up: the URL is http(s) and the options are usable."""
    url = kwargs.get("url")
    parts = urlparse(url) if isinstance(url, str) else None
    try:
        usable = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname) and (
            parts.port is None or parts.port > 0)
    except ValueError:  # a port that is not a number (`urlparse` reads it lazily)
        usable = False
    if not usable:
        raise ValueError(f"kwargs.url must be the reward server's http(s) URL (e.g. http://rm-host:5000/get_reward), "
                         f"got {url!r}")
    unknown = sorted(set(kwargs) - {"url", "score_key", "timeout_s", "retries"})
    if unknown:
        raise ValueError(f"unknown kwargs {unknown}; remote takes url, score_key, timeout_s, retries")
    timeout, retries = kwargs.get("timeout_s", 60.0), kwargs.get("retries", 3)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"kwargs.timeout_s must be a number of seconds > 0, got {timeout!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"kwargs.retries must be an integer >= 0, got {retries!r}")


__all__ = ["check_remote_kwargs", "remote_reward"]
