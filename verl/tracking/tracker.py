"""One `Tracker.log(metrics, step)` fans out to every configured backend.

Console and JSONL are always available; TensorBoard, wandb and MLflow are optional extras that fail at
start-up with an install hint, not halfway through a run. Importing this module imports none of them.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from verl.errors import ConfigError, disk_full_cause, disk_full_error, install_hint
from verl.tracking.console import CONSOLE_KEYS, ConsoleReporter  # noqa: F401  (CONSOLE_KEYS: re-exported)
from verl.utils.jsonl import drop_partial_tail, read_jsonl

KNOWN_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# Install hints: `verl` on PyPI is another project, so never `pip install 'verl[...]'`.
INSTALL_HINTS = {name: install_hint(name, name) for name in ("tensorboard", "wandb", "mlflow")}
ROTATED_FILES = ("metrics.jsonl", "samples.jsonl", "rollouts.jsonl", "tokens.jsonl")
SAMPLE_FIELDS = ("step", "prompt", "response", "score", "ground_truth", "data_source")


def _missing(backend: str) -> ConfigError:
    return ConfigError(f"logging.backends has {backend!r} but it is not installed. Fix: {INSTALL_HINTS[backend]}, "
                       f"or remove {backend!r} from logging.backends")


def backend_problems(backends: Iterable[str]) -> list[ConfigError]:
    """Unknown backends and optional ones that are not installed, found without importing them (wandb
    alone takes seconds), so the start-up checks report them once, before any process starts."""
    from importlib.util import find_spec

    names = list(dict.fromkeys(backends))
    unknown = [b for b in names if b not in KNOWN_BACKENDS]
    problems = [ConfigError(f"logging.backends: unknown backend(s) {unknown}; choose from {list(KNOWN_BACKENDS)}")
                ] if unknown else []
    return problems + [_missing(b) for b in names if b in INSTALL_HINTS and find_spec(b) is None]


def rotate(path: Path) -> Path | None:
    """Move a non-empty `path` to the first free `path.1`, `path.2`, ...; returns where it went."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    target = path.with_name(f"{path.name}.{n}")
    path.replace(target)
    return target


def _flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= _flat_params(value, f"{name}.")
        else:
            out[name] = json.dumps(value, default=str)[:500]  # MLflow's limit on a parameter value
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl (for plots, tests and resume)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return read_jsonl(path)  # a partial last line (a crash mid-write): dropped, with one warning


class Tracker:
    """Fans one `log(metrics, step)` out to every backend, and owns the run's console output.

    `fresh=True` (a run that starts from scratch, not a resume) first moves an old `metrics.jsonl` /
    `samples.jsonl` aside to `metrics.jsonl.1` (`.2`, ...) so two runs never mix in one file; `rotated`
    lists what moved.
    """

    def __init__(
        self,
        backends: Iterable[str],
        run_dir: str | Path,
        *,
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        project: str = "verl",
        experiment: str | None = None,
        enabled: bool = True,
        resume_step: int = 0,
        fresh: bool = False,
        mlflow_tracking_uri: str | None = None,
        console_file: IO[str] | None = None,
    ) -> None:
        self.backends = list(dict.fromkeys(backends))
        unknown = backend_problems(b for b in self.backends if b not in KNOWN_BACKENDS)
        if unknown:
            raise unknown[0]
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.rotated: list[tuple[Path, Path]] = []
        self._jsonl = self._tb = self._wandb = self._mlflow = None
        self.console: ConsoleReporter | None = None
        if not enabled:
            return
        # Optional backends first: a missing extra fails before anything is written.
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise _missing("tensorboard") from exc
        if "wandb" in self.backends:
            try:
                import wandb
            except ImportError as exc:
                raise _missing("wandb") from exc
        if "mlflow" in self.backends:
            try:
                from mlflow.tracking import MlflowClient
            except ImportError as exc:
                raise _missing("mlflow") from exc
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if (cause := disk_full_cause(exc)) is None:
                raise
            raise disk_full_error(cause, f"creating the run folder {self.run_dir}", self.run_dir) from exc
        if fresh:
            for name in ROTATED_FILES:
                moved = rotate(self.run_dir / name)
                if moved is not None:
                    self.rotated.append((self.run_dir / name, moved))
        for name in ROTATED_FILES:  # a resume never appends to the end of a line a crash left half-written
            drop_partial_tail(self.run_dir / name)
        if "jsonl" in self.backends:
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if "tensorboard" in self.backends:
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if "wandb" in self.backends:
            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}),
                                     dir=str(self.run_dir))
        if "mlflow" in self.backends:
            uri = mlflow_tracking_uri or (self.run_dir / "mlruns").resolve().as_uri()
            if mlflow_tracking_uri is None:
                # MLflow 3 refuses a file store unless asked; ours is the documented default, in the run dir
                # (a server or `sqlite:///...` goes in logging.mlflow_tracking_uri).
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            client = MlflowClient(tracking_uri=uri)
            found = client.get_experiment_by_name(project)
            experiment_id = found.experiment_id if found is not None else client.create_experiment(project)
            run = client.create_run(experiment_id, run_name=experiment or self.run_dir.name)
            self._mlflow = (client, run.info.run_id)
            self.mlflow_uri = uri
            if config:
                from mlflow.entities import Param

                params = [Param(k, v) for k, v in _flat_params(config).items()]
                for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                    client.log_batch(run.info.run_id, params=params[i:i + 100])
        if "console" in self.backends:
            self.console = ConsoleReporter(total_steps, start_step=resume_step, file=console_file)

    # ------------------------------------------------------------------ console
    def print(self, text: str) -> None:
        """A line for the user (banner, notices): on the console when it is on, else nowhere."""
        if self.console is not None:
            self.console.print(text)

    def start_progress(self, step: int) -> None:
        if self.console is not None:
            self.console.start(step)

    def progress(self, step: int) -> None:
        if self.console is not None:
            self.console.advance(step)

    def eta(self, step: int) -> str:
        return self.console.eta(step) if self.console is not None else "?"

    # ------------------------------------------------------------------ files
    def truncate_after(self, step: int) -> None:
        """Drop metrics and sample rows past `step` (written by a run that crashed after its last checkpoint)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.close()
        for name in ROTATED_FILES:
            path = self.run_dir / name
            if not path.is_file():
                continue
            kept = [row for row in read_metrics(path) if row.get("step", 0) <= step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
            tmp.replace(path)
        if self._jsonl is not None:
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")

    # ------------------------------------------------------------------ logging
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if self._jsonl is not None:
            row = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
            try:
                self._jsonl.write(json.dumps(row) + "\n")
                self._jsonl.flush()
            except OSError as exc:
                self._jsonl, fh = None, self._jsonl
                err = self._write_failed(exc, fh, self.run_dir / "metrics.jsonl", f"writing step {step}'s metrics")
                if err is exc:
                    raise
                raise err from exc
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            from mlflow.entities import Metric

            client, run_id = self._mlflow
            now = int(time.time() * 1000)
            finite = [Metric(k, v, now, step) for k, v in clean.items() if math.isfinite(v)]
            for i in range(0, len(finite), 1000):
                client.log_batch(run_id, metrics=finite[i:i + 1000])
        if self.console is not None:
            self.console.log(step, clean)

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> Path | None:
        """Validation generations: appended to samples.jsonl, a few printed, and sent to TensorBoard, wandb
        and MLflow as text when they are on. Returns the samples.jsonl path (None when disabled/empty)."""
        if not self.enabled or not samples:
            return None
        # reward_extras: a reward function's non-numeric extras (e.g. the parsed answer), where there are any
        rows = [{"step": step, **{k: s.get(k) for k in SAMPLE_FIELDS if k != "step"},
                 **({"reward_extras": s["reward_extras"]} if s.get("reward_extras") else {})} for s in samples]
        path = self.log_rows("samples.jsonl", rows, f"step {step}'s validation samples")
        if self._tb is not None:
            self._tb.add_text("val/samples", samples_markdown(rows), step)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(SAMPLE_FIELDS),
                                data=[[r["step"], *(_cell(r[k]) for k in SAMPLE_FIELDS[1:])] for r in rows])
            self._wandb.log({"val/samples": table}, step=step)
        if self._mlflow is not None:
            client, run_id = self._mlflow
            client.log_text(run_id, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows),
                            f"samples/step_{step:07d}.jsonl")
        if self.console is not None:
            self.console.samples(step, rows, str(path))
        return path

    def log_rows(self, name: str, rows: Sequence[Mapping[str, Any]], what: str) -> Path:
        """Append `rows` to `<run_dir>/<name>` as JSON lines (`what` names them in a disk-full error)."""
        path = self.run_dir / name
        if not self.enabled or not rows:
            return path
        fh = None
        try:  # text from a model or an agent may hold a lone surrogate: written as its JSON escape
            fh = path.open("a", encoding="utf-8", errors="backslashreplace")
            fh.write("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))
            fh.close()
        except OSError as exc:
            err = self._write_failed(exc, fh, path, f"writing {what}")
            if err is exc:
                raise
            raise err from exc
        return path

    def _write_failed(self, exc: OSError, fh: IO[str] | None, path: Path, what: str) -> BaseException:
        """A full disk: the rows of this write are cut off again (the file ends with the last whole line, so
        nothing half-written is read later) and the one-line DiskFullError comes back; other errors as they are."""
        size = None
        if fh is not None:
            try:
                fh.close()  # flushing again fails the same way; the handle is closed all the same
            except OSError:
                pass
        if (cause := disk_full_cause(exc)) is None:
            return exc
        try:
            data = path.read_bytes()
            size = data.rfind(b"\n") + 1  # the end of the last complete row
            if size != len(data):
                os.truncate(path, size)  # shrinking needs no space
        except OSError:
            pass
        return disk_full_error(cause, f"{what} to {path}", self.run_dir)

    def close(self) -> None:
        if self.console is not None:
            self.console.stop()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            client, run_id = self._mlflow
            client.set_terminated(run_id)
            self._mlflow = None


def _cell(value: Any) -> Any:
    return value if isinstance(value, (str, int, float)) or value is None else json.dumps(value, default=str)


def samples_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of samples (TensorBoard renders text summaries as markdown)."""
    def esc(value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_FIELDS) + " |", "|" + "---|" * len(SAMPLE_FIELDS)]
    lines += ["| " + " | ".join(esc(r.get(k)) for k in SAMPLE_FIELDS) + " |" for r in rows]
    return "\n".join(lines)
