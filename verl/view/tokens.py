"""`tokens.jsonl`: a few sampled responses per step with a value per token (log-prob, entropy, advantage,
importance ratio, sampler-vs-trainer gap, ...), indexed by step so one response is read at a time.

The value names are not fixed: whatever the trainer records is offered. Arrays shorter or longer than the
token list (a writer's bug) are cut or padded with None rather than refused, so the rest still shows.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from verl.errors import ViewError
from verl.view.tail import JsonlTail, Line, TailIndex, parse_line
from verl.view.values import as_int, as_text, clip, num

MAX_TOKENS = 32_768  # tokens of one response shown


def _fit(values: Any, n: int, convert) -> list:
    values = values if isinstance(values, list) else []
    return [convert(v) for v in values[:n]] + [convert(None)] * max(0, n - len(values))


def _flag(value: Any) -> int:
    return 1 if value in (1, True) else 0


def normalize_tokens(row_id: int, row: dict[str, Any]) -> dict[str, Any]:
    """A tokens row as the page shows it: text pieces, each value list as long as the tokens, flags 0/1."""
    tokens = row.get("tokens") if isinstance(row.get("tokens"), list) else []
    cut = len(tokens) > MAX_TOKENS
    tokens = [as_text(t) for t in tokens[:MAX_TOKENS]]
    n = len(tokens)
    values = row.get("values") if isinstance(row.get("values"), dict) else {}
    return {"id": row_id, "step": as_int(row.get("step")), "sample": as_int(row.get("sample")),
            "group": clip(as_text(row.get("group")), 200),
            "prompt": clip(as_text(row.get("prompt")), 20000), "tokens": tokens,
            "values": {clip(str(k), 100): _fit(v, n, num) for k, v in values.items()},
            "masked": _fit(row.get("masked"), n, _flag), "clipped": _fit(row.get("clipped"), n, _flag),
            "cut": cut}


class TokenIndex(TailIndex):
    """Where each response of tokens.jsonl is, by step; `refresh()` reads what was appended."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tail = JsonlTail(self.path)
        self.lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        # offset, length, step, group, prompt, n, sample (the rollouts.jsonl row of the same step and number)
        self.entries: list[tuple[int, int, int, str, str, int, int | None]] = []
        self.by_step: dict[int, list[int]] = {}
        self.names: dict[str, None] = {}

    def _add(self, line: Line) -> None:
        row = line.row
        step = as_int(row.get("step"))
        step = -1 if step is None else step
        tokens, values = row.get("tokens"), row.get("values")
        for name in values if isinstance(values, dict) else ():
            if len(self.names) < 64:
                self.names.setdefault(clip(str(name), 100))
        self.by_step.setdefault(step, []).append(len(self.entries))
        self.entries.append((line.offset, line.length, step, clip(as_text(row.get("group")), 200),
                             clip(as_text(row.get("prompt")), 120), len(tokens) if isinstance(tokens, list) else 0,
                             as_int(row.get("sample"))))

    def summary(self) -> dict[str, Any]:
        with self.lock:
            return {"steps": [[s, len(ids)] for s, ids in sorted(self.by_step.items())], "names": list(self.names),
                    "rows": len(self.entries), "bad_lines": self.tail.bad_lines,
                    "problems": list(self.tail.problems)}

    def list_step(self, step: int) -> list[dict[str, Any]]:
        """The responses of `step`: id, group, the prompt's start and the token count (no tokens)."""
        with self.lock:
            return [{"id": i, "step": step, "group": self.entries[i][3], "prompt": self.entries[i][4],
                     "n": self.entries[i][5], "sample": self.entries[i][6]} for i in self.by_step.get(step, [])]

    def get(self, row_id: int) -> dict[str, Any]:
        with self.lock:
            if not 0 <= row_id < len(self.entries):
                raise ViewError(f"tokens.jsonl has no response {row_id} (it has {len(self.entries)})")
            offset, length = self.entries[row_id][:2]
            try:
                with self.path.open("rb") as fh:
                    fh.seek(offset)
                    row = parse_line(fh.read(length))
            except (OSError, ValueError) as exc:
                raise ViewError(f"{self.path}: response {row_id} could not be read again ({exc}); the file was "
                                "replaced: reload the page") from None
        return normalize_tokens(row_id, row)


__all__ = ["MAX_TOKENS", "TokenIndex", "normalize_tokens"]
