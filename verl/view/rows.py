"""The rows of `samples.jsonl` (validation) and `rollouts.jsonl` (training), indexed as they are written.

A samples file can reach a gigabyte, so the index keeps, per row, only its byte offset and the few numbers the
filters and sorts need (step, reward, each reward function's part, advantage, length, data source, a key of
the prompt's text, episode status), in flat arrays; the text is read back from the file for the rows a page
shows. A text search reads rows lazily and stops after `SCAN_LIMIT` of them, saying there may be more.
"""

from __future__ import annotations

import math
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl.errors import ViewError
from verl.view.tail import JsonlTail, Line, TailIndex, parse_line
from verl.view.values import TABLE_CLIP, TURN_CLIP, as_int, as_text, clip, num, prompt_hash

STATUSES = ("ok", "timeout", "failed", "restarted", "truncated")
OTHER_STATUS, NO_EPISODE = len(STATUSES), -1
MAX_LIMIT = 200  # rows in one answer
SCAN_LIMIT = 50_000  # rows one text search reads before it answers
TEXT_SORT_LIMIT = 20_000  # rows a sort by a text column may read
INDEX_BYTES_PER_POLL = 256 * 1024 * 1024  # a huge file is indexed over several requests
NUMERIC_SORTS = ("step", "reward", "advantage", "response_length")
TEXT_SORTS = ("group", "prompt", "response", "ground_truth", "data_source")
NAN = float("nan")


@dataclass
class Query:
    """One request for rows; every field optional. `prompt_hash`: the rows of one prompt text (hex key);
    `status`: an episode status, or "bad" for every status but ok; `sort`: a column, `r:NAME` a reward part."""

    step: int | None = None
    q: str = ""
    data_source: str | None = None
    rmin: float | None = None
    rmax: float | None = None
    prompt_hash: str | None = None
    episodes: bool = False
    status: str | None = None
    sort: str = ""
    desc: bool = False
    offset: int = 0
    limit: int = 50


def normalize(row_id: int, row: dict[str, Any], kind: str, *, table: bool = True) -> dict[str, Any]:
    """A row in the shape the page shows, whichever file it came from; text clipped, numbers finite or None."""
    reward = row.get("score") if kind == "samples" else row.get("reward")
    rewards = row.get("rewards") if isinstance(row.get("rewards"), dict) else {}
    extras = row.get("reward_extras")
    episode = row.get("episode") if isinstance(row.get("episode"), dict) else None
    text_limit = TABLE_CLIP if table else TURN_CLIP
    prompt = as_text(row.get("prompt"))
    out = {
        "id": row_id, "step": as_int(row.get("step")), "sample": as_int(row.get("sample")),
        "group": clip(as_text(row.get("group")), 200),
        "prompt": clip(prompt, text_limit), "response": clip(as_text(row.get("response")), text_limit),
        "ground_truth": clip(as_text(row.get("ground_truth")), 1000),
        "data_source": clip(as_text(row.get("data_source")), 200), "reward": num(reward),
        "rewards": {clip(str(k), 200): num(v) for k, v in rewards.items()},
        "advantage": num(row.get("advantage")), "response_length": as_int(row.get("response_length")),
        "extras": clip(as_text(extras), 1000) if extras not in (None, {}, []) else None,
        "ph": format(prompt_hash(prompt), "016x"), "episode": None,
    }
    if episode is not None:
        turns = episode.get("turns") if isinstance(episode.get("turns"), list) else []
        out["episode"] = {
            "status": clip(as_text(episode.get("status")), 100),
            "error": clip(as_text(episode.get("error")), 2000) or None,
            "turns": [{"role": clip(as_text(t.get("role")), 50), "text": clip(as_text(t.get("text")), TURN_CLIP),
                       "trained": t.get("trained") is True, "reward": num(t.get("reward")),
                       "error": clip(as_text(t.get("error")), 2000) or None}
                      for t in turns if isinstance(t, dict)],
            # anything else the trainer counts per episode (tool calls, tool errors, ...), shown in its header
            "counts": {clip(str(k), 100): num(v) for k, v in list(episode.items())[:20]
                       if k not in ("status", "error", "turns") and num(v) is not None},
        }
    return out


def _status_code(row: dict[str, Any]) -> int:
    episode = row.get("episode")
    if not isinstance(episode, dict):
        return NO_EPISODE
    status = episode.get("status")
    return STATUSES.index(status) if status in STATUSES else OTHER_STATUS


def _matches_text(row: dict[str, Any], needle: str) -> bool:
    if needle in as_text(row.get("prompt")).lower() or needle in as_text(row.get("response")).lower():
        return True
    episode = row.get("episode")
    turns = episode.get("turns") if isinstance(episode, dict) else None
    return isinstance(turns, list) and any(isinstance(t, dict) and needle in as_text(t.get("text")).lower()
                                           for t in turns)


def _nan_last(value: float, desc: bool) -> tuple[int, float]:
    if math.isnan(value):
        return (1, 0.0)
    return (0, -value if desc else value)


class RowIndex(TailIndex):
    """The index of one samples or rollouts file; `refresh()` reads what was appended, `query()` answers."""

    def __init__(self, path: str | Path, kind: str, *, index_bytes: int = INDEX_BYTES_PER_POLL) -> None:
        if kind not in ("samples", "rollouts"):
            raise ValueError(kind)
        self.path, self.kind, self.index_bytes = Path(path), kind, index_bytes
        self.tail = JsonlTail(self.path)
        self.lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self.offsets, self.lengths, self.steps = array("q"), array("q"), array("q")
        self.reward, self.advantage, self.resp_len = array("d"), array("d"), array("q")
        self.ph, self.ds, self.status = array("Q"), array("l"), array("b")
        self.parts: dict[str, array] = {}  # reward function name -> its value per row (NaN: not given)
        self.by_step: dict[int, array] = {}
        self.episodes = 0
        self.ds_names: list[str] = []
        self._ds_ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.offsets)

    def _add(self, line: Line) -> None:
        row, i = line.row, len(self.offsets)
        step = as_int(row.get("step"))
        step = -1 if step is None else step
        self.offsets.append(line.offset)
        self.lengths.append(line.length)
        self.steps.append(step)
        reward = num(row.get("score") if self.kind == "samples" else row.get("reward"))
        self.reward.append(NAN if reward is None else reward)
        advantage = num(row.get("advantage"))
        self.advantage.append(NAN if advantage is None else advantage)
        length = as_int(row.get("response_length"))
        self.resp_len.append(-1 if length is None else length)
        self.ph.append(prompt_hash(as_text(row.get("prompt"))))
        source = as_text(row.get("data_source"))[:200]
        if source not in self._ds_ids:
            self._ds_ids[source] = len(self.ds_names)
            self.ds_names.append(source)
        self.ds.append(self._ds_ids[source])
        self.status.append(_status_code(row))
        self.episodes += self.status[i] != NO_EPISODE
        parts = row.get("rewards")
        for name, value in (parts.items() if isinstance(parts, dict) else ()):
            name = str(name)[:200]
            if name not in self.parts:
                if len(self.parts) >= 64:  # a writer that names every row's reward differently: stop adding columns
                    continue
                self.parts[name] = array("d", [NAN]) * i
            value = num(value)
            self.parts[name].append(NAN if value is None else value)
        for values in self.parts.values():
            if len(values) < i + 1:
                values.append(NAN)
        self.by_step.setdefault(step, array("q")).append(i)

    # ------------------------------------------------------------------ answers
    def summary(self) -> dict[str, Any]:
        """Steps (with row counts), data sources, reward parts, and how far indexing has got."""
        with self.lock:
            return {"steps": [[s, len(ids)] for s, ids in sorted(self.by_step.items())],
                    "data_sources": sorted(self.ds_names), "reward_names": list(self.parts),
                    "rows": len(self), "episodes": self.episodes,
                    "indexed_bytes": self.tail.offset, "size": self.tail.size(),
                    "bad_lines": self.tail.bad_lines, "problems": list(self.tail.problems)}

    def read(self, ids: list[int], *, table: bool = True) -> list[dict[str, Any]]:
        """The rows `ids`, read back from the file in the shape the page shows."""
        return [normalize(i, row, self.kind, table=table) for i, row in self._read_raw(ids)]

    def _read_raw(self, ids):
        if not ids:
            return
        with self.path.open("rb") as fh:
            for i in ids:
                row = self._read_one(fh, i)
                if row is not None:  # None: the file was replaced under us; the next refresh rebuilds the index
                    yield i, row

    def _read_one(self, fh, i: int, must_hold: bytes | None = None) -> dict[str, Any] | None:
        """Row `i`; None when it cannot be parsed, or when its bytes (lower-cased) do not hold `must_hold`,
        which saves a search the parsing of the rows that cannot match."""
        fh.seek(self.offsets[i])
        raw = fh.read(self.lengths[i])
        if must_hold is not None and must_hold not in raw.lower():
            return None
        try:
            return parse_line(raw)
        except ValueError:
            return None

    def _candidates(self, query: Query) -> list[int]:
        ids = list(self.by_step.get(query.step, ())) if query.step is not None else list(range(len(self)))
        if query.data_source is not None:
            want = self._ds_ids.get(query.data_source)
            ids = [i for i in ids if self.ds[i] == want]
        if query.rmin is not None:
            ids = [i for i in ids if self.reward[i] >= query.rmin]  # NaN compares False: out
        if query.rmax is not None:
            ids = [i for i in ids if self.reward[i] <= query.rmax]
        if query.prompt_hash:
            try:
                key = int(query.prompt_hash, 16)
            except ValueError:
                raise ViewError(f"ph={query.prompt_hash!r} is not a prompt key (16 hex digits)") from None
            ids = [i for i in ids if self.ph[i] == key]
        if query.episodes:
            ids = [i for i in ids if self.status[i] != NO_EPISODE]
        if query.status:
            if query.status == "bad":
                ids = [i for i in ids if self.status[i] not in (NO_EPISODE, 0)]
            elif query.status in STATUSES:
                code = STATUSES.index(query.status)
                ids = [i for i in ids if self.status[i] == code]
            else:
                raise ViewError(f"status={query.status!r}: choose one of {', '.join(STATUSES)} or bad")
        return ids

    def _sorted(self, ids: list[int], query: Query) -> list[int]:
        key, desc = query.sort, query.desc
        if not key:
            return ids
        columns = {"reward": self.reward, "advantage": self.advantage}
        if key in columns:
            column = columns[key]
            return sorted(ids, key=lambda i: _nan_last(column[i], desc))
        if key.startswith("r:"):
            column = self.parts.get(key[2:])
            if column is None:
                raise ViewError(f"sort={key!r}: no reward function of that name in {self.path.name}; it has "
                                f"{', '.join(self.parts) or 'none'}")
            return sorted(ids, key=lambda i: _nan_last(column[i], desc))
        if key in ("step", "response_length"):
            column = self.steps if key == "step" else self.resp_len
            return sorted(ids, key=lambda i: column[i], reverse=desc)
        if key == "data_source":
            return sorted(ids, key=lambda i: self.ds_names[self.ds[i]], reverse=desc)
        if key in TEXT_SORTS:
            if len(ids) > TEXT_SORT_LIMIT:
                raise ViewError(f"sorting {len(ids)} rows by {key} would read them all: choose a step or a filter "
                                f"first (at most {TEXT_SORT_LIMIT} rows)")
            text = {i: as_text(row.get(key)) for i, row in self._read_raw(ids)}
            return sorted(ids, key=lambda i: text.get(i, ""), reverse=desc)
        raise ViewError(f"sort={key!r}: sort by one of {', '.join(NUMERIC_SORTS + TEXT_SORTS)} or r:NAME")

    def query(self, query: Query) -> dict[str, Any]:
        """One page of matching rows, and `next`: the offset of the next page (None at the end). With a text
        search the offset is where the scan starts, and a scan reads at most SCAN_LIMIT rows, so `total` is
        known only when one scan from the start read them all."""
        limit = max(1, min(query.limit, MAX_LIMIT))
        offset = max(0, query.offset)
        with self.lock:
            ids = self._sorted(self._candidates(query), query)
            if not query.q:
                end = offset + limit
                return {"rows": self.read(ids[offset:end]), "total": len(ids),
                        "next": end if end < len(ids) else None, "scanned": 0}
            needle, page, scanned, pos = query.q.lower(), [], 0, offset
            # JSON keeps printable ASCII other than quote and backslash as it is: such a needle is in the bytes
            plain = needle.isascii() and needle.isprintable() and not set(needle) & set('"\\/')
            must_hold = needle.encode("ascii") if plain else None
            if ids and pos < len(ids):
                with self.path.open("rb") as fh:
                    while pos < len(ids) and len(page) < limit and scanned < SCAN_LIMIT:
                        i = ids[pos]
                        pos, scanned = pos + 1, scanned + 1
                        row = self._read_one(fh, i, must_hold)
                        if row is not None and _matches_text(row, needle):
                            page.append(normalize(i, row, self.kind))
            following = pos if pos < len(ids) else None
            return {"rows": page, "total": len(page) if offset == 0 and following is None else None,
                    "next": following, "scanned": scanned}


__all__ = ["MAX_LIMIT", "Query", "RowIndex", "SCAN_LIMIT", "STATUSES", "normalize"]
