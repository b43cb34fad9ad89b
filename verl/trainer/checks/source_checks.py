"""Where the models come from: a hub id that is neither on disk nor reachable fails in seconds.

Without a network, transformers retries a hub id for about a minute per file before it gives up. One probe
here (the local Hugging Face cache, `HF_HUB_OFFLINE`, one short HEAD request to the hub) tells the same
thing in at most `HUB_PROBE_TIMEOUT_S`, before anything loads. A local folder or `tiny` costs one `stat`.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from verl.errors import ModelError, VerlError
from verl.models.tiny import is_tiny_spec

HUB_PROBE_TIMEOUT_S = 3.0
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


def model_sources(config: Any, kind: str, *, policy_given: bool = False) -> dict[str, str]:
    """config key -> model path, for every model this run would load from a path (tokenizer included)."""
    out: dict[str, str] = {}
    if not policy_given:
        out["model.path"] = config.model.path
        if config.model.tokenizer_path:
            out["model.tokenizer_path"] = config.model.tokenizer_path
    if config.ref.path and ((kind == "rl" and config.needs_ref) or kind == "dpo"):
        out["ref.path"] = config.ref.path
    if kind == "rl" and config.critic.path and config.needs_critic:
        out["critic.path"] = config.critic.path
    if kind == "rl" and config.reward.model_path:
        out["reward.model_path"] = config.reward.model_path
    if kind == "rl" and config.needs_teacher:
        out["algorithm.distill.teacher_path"] = config.algorithm.distill.teacher_path
    return out


def is_hub_id(path: str, *, tiny_ok: bool = True) -> bool:
    """`org/name` (or `name`) that is not a folder here: transformers would fetch it from the hub."""
    if (tiny_ok and is_tiny_spec(path)) or path.startswith(("/", ".", "~")) or not _HUB_ID.match(path):
        return False
    return not Path(path).exists()


def hub_cache_dir() -> Path:
    """The hub cache transformers reads (the environment as it is now, then huggingface_hub's default)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def in_hub_cache(repo_id: str) -> bool:
    """Some snapshot of `repo_id` was downloaded into the cache (which files, the loader checks)."""
    snapshots = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def offline_variable() -> str | None:
    """The environment variable that forbids downloads, if one is set."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return name
    return None


def hub_endpoint() -> str:
    if os.environ.get("HF_ENDPOINT"):
        return os.environ["HF_ENDPOINT"].rstrip("/")
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def probe_hub(repo_id: str, revision: str | None = None, *, timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when the hub answers (below 500: a gated or missing repo is the loader's to explain), else why it
    cannot be reached. One HEAD request, no retries."""
    url = f"{hub_endpoint()}/{repo_id}/resolve/{revision or 'main'}/config.json"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:  # a proxy's 502/503/504 means no hub behind it
        return f"{hub_endpoint()}: HTTP {exc.code} {exc.reason}" if exc.code >= 500 else None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{hub_endpoint()}: {f'no answer within {timeout:g} s' if isinstance(reason, TimeoutError) else reason}"


def check_model_sources(config: Any, kind: str, *,
                        policy_given: bool = False) -> tuple[list[VerlError], list[VerlError]]:
    """(problems, warnings) for the hub ids among the run's model paths: not cached and the hub is offline
    or unreachable is a problem; cached while the hub is unreachable is a warning (the loader would still
    spend its retries before it falls back to the cache)."""
    sources: dict[str, list[str]] = {}
    for key, path in model_sources(config, kind, policy_given=policy_given).items():
        if is_hub_id(path, tiny_ok=key != "model.tokenizer_path"):
            sources.setdefault(path, []).append(key)
    problems: list[VerlError] = []
    warnings: list[VerlError] = []
    unreachable: str | None = None
    probed = False
    for repo_id, keys in sources.items():
        where = " and ".join(f"{k}={repo_id}" for k in keys)
        offline = offline_variable()
        cached = in_hub_cache(repo_id)
        if cached and offline:
            continue
        if not offline and not probed:  # one request: an unreachable hub is unreachable for every id
            revision = config.model.revision if "model.path" in keys else None
            unreachable, probed = probe_hub(repo_id, revision), True
        if offline is None and unreachable is None:
            continue
        if cached:
            warnings.append(ModelError(
                f"{where} is in the local Hugging Face cache, but the hub cannot be reached ({unreachable}); "
                "the loader would try the hub "
                "(retrying for about a minute) before using the cache. Fix: set HF_HUB_OFFLINE=1"))
            continue
        why = (f"{offline}={os.environ[offline]} forbids downloading it" if offline
               else f"the hub cannot be reached ({unreachable})")
        problems.append(ModelError(
            f"{where} is a Hugging Face hub id that is not on this machine (not a folder here, not in the "
            f"cache {hub_cache_dir()}), and {why}. Fix: download it where there is network "
            f"(`huggingface-cli download {repo_id}`) into the cache this run reads (or copy that cache and set "
            f"HF_HOME to it), or set {keys[0]} to a local folder with the model"))
    return problems, warnings


__all__ = ["HUB_PROBE_TIMEOUT_S", "check_model_sources", "hub_cache_dir", "in_hub_cache", "is_hub_id",
           "model_sources", "offline_variable", "probe_hub"]
