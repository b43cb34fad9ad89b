"""The run folders a `verl view` shows, each with its four readers, and the questions the page asks of them.

The page names a run by its number in the command line, never by a path: nothing a request carries reaches
the filesystem. `answer(route, params)` is the whole API; the live server calls it per request, and the
report builder calls it once to embed the same answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl.errors import ViewError
from verl.view.metrics import MetricsLog
from verl.view.rows import MAX_LIMIT, Query, RowIndex
from verl.view.tokens import TokenIndex

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "rollouts.jsonl", "tokens.jsonl")


class Run:
    """One run folder: metrics, validation samples, training rollouts (with episodes), token values."""

    def __init__(self, number: int, path: Path, name: str) -> None:
        self.number, self.path, self.name = number, path, name
        self.metrics = MetricsLog(path)
        self.rows = {"samples": RowIndex(path / "samples.jsonl", "samples"),
                     "rollouts": RowIndex(path / "rollouts.jsonl", "rollouts")}
        self.tokens = TokenIndex(path / "tokens.jsonl")

    def refresh(self) -> None:
        self.metrics.refresh()
        for index in self.rows.values():
            index.refresh()
        self.tokens.refresh()

    def describe(self) -> dict[str, Any]:
        return {"id": self.number, "name": self.name, "path": str(self.path),
                "files": {name: (self.path / name).is_file() for name in RUN_FILES}}


def _names(paths: Sequence[Path]) -> list[str]:
    """Short distinct names: the folder's name, with as many parents as it takes to tell two apart."""
    depth = 1
    while True:
        names = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(names)) == len(names) or depth >= max(len(p.parts) for p in paths):
            return names if len(set(names)) == len(names) else [f"{n} ({i})" for i, n in enumerate(names)]
        depth += 1


def open_runs(folders: Sequence[str | Path]) -> list[Run]:
    """A Run per folder; a folder that does not exist is an error naming it."""
    if not folders:
        raise ViewError("verl view needs at least one run folder. Fix: verl view runs/demo (a trainer.run_dir)")
    paths = []
    for folder in folders:
        path = Path(folder).expanduser().resolve()
        if not path.is_dir():
            raise ViewError(f"verl view: {folder} is not a folder. Fix: give a run folder (trainer.run_dir: it holds "
                            f"{', '.join(RUN_FILES)})")
        paths.append(path)
    return [Run(i, p, name) for i, (p, name) in enumerate(zip(paths, _names(paths), strict=True))]


def _int(params: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    raw = params.get(key, "")
    if raw in ("", "all"):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ViewError(f"{key}={raw!r} is not an integer") from None


def _float(params: Mapping[str, str], key: str) -> float | None:
    raw = params.get(key, "")
    if raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ViewError(f"{key}={raw!r} is not a number") from None


def query_from(params: Mapping[str, str]) -> Query:
    """The row query a request's parameters describe (unknown parameters are ignored, like a browser's)."""
    return Query(step=_int(params, "step"), q=params.get("q", "")[:500], data_source=params.get("ds") or None,
                 rmin=_float(params, "rmin"), rmax=_float(params, "rmax"), prompt_hash=params.get("ph") or None,
                 episodes=params.get("episodes") in ("1", "true"), status=params.get("status") or None,
                 sort=params.get("sort", ""), desc=params.get("desc") in ("1", "true"),
                 offset=_int(params, "offset", 0) or 0, limit=min(_int(params, "limit", 50) or 50, MAX_LIMIT))


class Runs:
    """The runs of one `verl view`, and the API the page calls."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs

    def run(self, params: Mapping[str, str]) -> Run:
        number = _int(params, "run", 0)
        if number is None or not 0 <= number < len(self.runs):
            raise ViewError(f"run={params.get('run')!r}: this view shows runs 0..{len(self.runs) - 1}")
        return self.runs[number]

    def answer(self, route: str, params: Mapping[str, str]) -> dict[str, Any]:
        """The JSON for `/api/<route>`; a ViewError for a request it cannot answer."""
        if route == "runs":
            return {"runs": [r.describe() for r in self.runs]}
        run = self.run(params)
        if route == "metrics":
            run.metrics.refresh()
            return run.metrics.since(_int(params, "since", 0) or 0)
        if route in ("steps", "rows"):
            source = params.get("source", "rollouts")
            if source not in run.rows:
                raise ViewError(f"source={source!r}: choose samples (validation) or rollouts (training)")
            index = run.rows[source]
            index.refresh()
            return index.summary() if route == "steps" else index.query(query_from(params))
        if route == "tokens":
            run.tokens.refresh()
            step = _int(params, "step")
            summary = run.tokens.summary()
            if step is None and summary["steps"]:
                step = summary["steps"][-1][0]
            return {**summary, "step": step, "responses": [] if step is None else run.tokens.list_step(step)}
        if route == "token":
            run.tokens.refresh()
            return run.tokens.get(_int(params, "id", 0) or 0)
        raise ViewError(f"no such view API: {route}")


__all__ = ["RUN_FILES", "Run", "Runs", "open_runs", "query_from"]
