"""Synthetic run folders in the formats `verl view` reads, with a corpus of hostile content.

Hostile on purpose: markup and `</script>` in model text, NaN and Infinity in metrics (Python's json writes
them), a malformed line, a huge line, bytes that are not UTF-8, and a last line cut off mid-write.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PWN = "document.body.setAttribute('data-pwned','1')"
HOSTILE_RESPONSE = f"</script><script>{PWN}</script><img src=x onerror=\"{PWN}\"> answer"
NEEDLE = "zebra-needle"  # a word only one rollout's response holds
TOKEN_VALUE = -0.4321  # the logprob of one marked token
TOKEN_TEXT = "<b>tok</b>"  # that token's text (markup, to be shown as text)


def _line(row: dict) -> str:
    return json.dumps(row) + "\n"  # allow_nan: NaN / Infinity as Python writes them


def write_metrics(run: Path, steps: int, *, hostile: bool = True, seed: float = 0.0) -> None:
    lines = [_line({"step": 0, "val/accuracy": 0.3 + seed, "val/score": 0.3 + seed})]
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": 0.1 * s + seed, "actor/pg_loss": 0.05 / s, "actor/grad_norm": 1.0 + s,
               "rollout_corr/weight_mean": 1.0, "custom_prefix/thing": s * 2.0, "timing/generate": 0.5,
               "timing/update": 0.25 + 0.01 * s, "timing/step": 0.8, "episode/turns_mean": 2.0}
        if hostile and s == 2:
            row["actor/pg_loss"], row["actor/grad_norm"] = math.nan, math.inf
        if s % 2 == 0:
            row["val/accuracy"] = 0.3 + 0.05 * s + seed - (0.2 if s == steps else 0.0)
        lines.append(_line(row))
        if hostile and s == 3:
            lines.append("{this is not json\n")
    (run / "metrics.jsonl").write_text("".join(lines), encoding="utf-8")
    # an older run in the same folder, moved aside by a fresh start: never shown
    (run / "metrics.jsonl.1").write_text(_line({"step": 1, "old_run/only_in_rotated": 1.0}), encoding="utf-8")


def rollout(step: int, group: int, k: int, *, response: str | None = None, episode: dict | None = None) -> dict:
    reward = float((step + group + k) % 2)
    return {"step": step, "group": f"g{group}", "prompt": f"What is {group}+{group}?",
            "response": response or f"step {step} answer {k} to {group}",
            "data_source": "math" if group % 2 else "code",
            "ground_truth": str(2 * group), "reward": reward, "rewards": {"correct": reward, "format": 0.5},
            "advantage": reward - 0.5, "response_length": 5 + k, "episode": episode}


def episode(status: str) -> dict:
    return {"status": status, "error": None if status == "ok" else f"tool {status} <b>after</b> 30 s", "tool_calls": 1,
            "turns": [{"role": "system", "text": "You have a calculator.", "trained": False, "reward": None,
                       "error": None},
                      {"role": "assistant", "text": "<tool_call>{\"name\": \"calc\"}</tool_call>", "trained": True,
                       "reward": None, "error": None},
                      {"role": "tool", "text": "<script>alert(1)</script>42", "trained": False, "reward": 0.25,
                       "error": "exit 1" if status != "ok" else None},
                      {"role": "assistant", "text": "The answer is 42.", "trained": True, "reward": 1.0,
                       "error": None}]}


def write_rollouts(run: Path, steps: int, *, hostile: bool = True) -> None:
    data = b""
    for s in range(1, steps + 1):
        for g in range(2):
            for k in range(2):
                row = rollout(s, g, k)
                if s == 2 and g == 0 and k == 0:
                    row["response"] = f"the {NEEDLE} answer"
                if hostile and s == 1 and g == 1 and k == 1:
                    row["response"] = HOSTILE_RESPONSE
                if g == 1 and k == 0:
                    row["episode"] = episode(["ok", "timeout", "failed", "restarted"][s % 4])
                data += _line(row).encode("utf-8")
        if hostile and s == 1:
            data += b"not json at all\n"
            data += _line(rollout(1, 5, 0, response="x" * 300_000)).encode("utf-8")  # a huge line
            bad = _line(rollout(1, 6, 0, response="BYTES")).encode("utf-8").replace(b"BYTES", b"bad \xff\xfe bytes")
            data += bad  # not UTF-8
    if hostile:
        data += _line(rollout(steps + 1, 0, 0))[:40].encode("utf-8")  # a run writing its next line right now
    (run / "rollouts.jsonl").write_bytes(data)


def write_samples(run: Path, steps: int, *, hostile: bool = True) -> None:
    rows = []
    for s in range(0, steps + 1, 2):
        for i in range(3):
            rows.append({"step": s, "prompt": f"{i}+{s}=", "response": str(i + s + (i == 2)), "score": float(i != 2),
                         "ground_truth": str(i + s), "data_source": "arithmetic",
                         **({"reward_extras": {"parsed": i + s}} if i == 0 else {})})
    if hostile:
        rows.append({"step": 0, "prompt": "hostile", "response": HOSTILE_RESPONSE, "score": math.nan,
                     "ground_truth": None, "data_source": "<i>ds</i>"})
    (run / "samples.jsonl").write_text("".join(_line(r) for r in rows), encoding="utf-8")


def token_row(step: int, k: int) -> dict:
    tokens = ["The", " answer", " is", TOKEN_TEXT, "\n", "4", "2"]
    n = len(tokens)
    logprob = [-0.1 * (i + 1) for i in range(n)]
    if k == 0:
        logprob[3] = TOKEN_VALUE
    return {"step": step, "group": f"g{k}", "prompt": f"prompt {k} <script>x</script>", "tokens": tokens,
            "values": {"logprob": logprob, "entropy": [0.5 + 0.1 * i for i in range(n)],
                       "advantage": [0.5 if k == 0 else -0.5] * n, "ratio": [1.0, 1.1, 0.9, 1.3, 1.0, 1.0, 0.7],
                       "logprob_gap": [0.0, 0.01, -0.02, math.nan, 0.0, None, 0.0],
                       "rollout_corr_weight": [1.0] * n},
            "masked": [0, 0, 0, 0, 1, 0, 0], "clipped": [0, 0, 0, 1, 0, 0, 1]}


def write_tokens(run: Path, steps: int) -> None:
    lines = [_line(token_row(s, k)) for s in range(1, steps + 1) for k in range(2)]
    (run / "tokens.jsonl").write_text("".join(lines), encoding="utf-8")


def make_run(run: Path, steps: int = 6, *, hostile: bool = True, best: bool = True, seed: float = 0.0) -> Path:
    """A run folder with all four files (and checkpoints/best.json when `best`)."""
    run.mkdir(parents=True, exist_ok=True)
    write_metrics(run, steps, hostile=hostile, seed=seed)
    write_samples(run, steps, hostile=hostile)
    write_rollouts(run, steps, hostile=hostile)
    write_tokens(run, steps)
    if best:
        (run / "checkpoints").mkdir(exist_ok=True)
        (run / "checkpoints" / "best.json").write_text(json.dumps(
            {"step": 4, "metric": "val/accuracy", "mode": "max", "value": 0.5 + seed}), encoding="utf-8")
    return run
