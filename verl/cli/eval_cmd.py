"""`verl eval MODEL [DATA] [key=value ...]`: pass@k, maj@k and mean@k of a model or checkpoint on a dataset.

The numbers come from the trainer's validation code (verl.trainer.eval_run); this module is the command
line: arguments, a progress bar while sampling, a table of the metrics (overall and per data_source) and the
JSON file (`--out`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from verl.errors import ConfigError


def parse_ks(values: list[str] | None) -> tuple[list[int] | None, list[str]]:
    """`--k 1 4 8` or `--k 1,4,8` -> ([1, 4, 8], key=value overrides typed right after the k values)."""
    if values is None:
        return None, []
    ks, overrides = [], []
    for value in values:
        if "=" in value:
            overrides.append(value)
            continue
        try:
            ks += [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise ConfigError(f"--k {value}: k values are integers, e.g. --k 1 4 8") from None
    return ks, overrides


def split_items(items: list[str]) -> tuple[str, str | None, list[str]]:
    """(MODEL, DATA or None, key=value overrides) from the positionals as typed."""
    plain = [item for item in items if "=" not in item]
    overrides = [item for item in items if "=" in item]
    if not plain:
        raise ConfigError("verl eval needs a MODEL: a checkpoint folder (<run>/checkpoints/step_N), a run folder, "
                          "a Hugging Face model folder or hub id, or `tiny`. Example: verl eval runs/x/checkpoints/"
                          "step_100 test.jsonl --n 8 --k 1 4 8")
    if len(plain) > 2:
        raise ConfigError(f"verl eval takes MODEL and at most one DATA file, then key=value overrides; got "
                          f"{plain}. Fix: name one data file (a folder of files works too)")
    return plain[0], (plain[1] if len(plain) == 2 else None), overrides


def _fmt(value: float) -> str:
    return f"{value:.4f}"


def metrics_table(result: Any) -> Any:
    """A rich table: a row per metric, a column for all prompts and one per data_source (when several)."""
    from rich.table import Table

    table = Table(title=f"verl eval: {result.rows} prompts x {result.n} answers "
                  f"(temperature {result.temperature:g})", title_justify="left")
    sources = list(result.by_data_source) if len(result.by_data_source) > 1 else []
    table.add_column("metric")
    for name in ["all", *sources]:
        table.add_column(name, justify="right")
    table.add_row("prompts", str(result.rows), *(str(result.source_rows.get(s, "")) for s in sources))
    for metric, value in result.metrics.items():
        table.add_row(metric, _fmt(value), *(_fmt(result.by_data_source[s][metric])
                                             if metric in result.by_data_source[s] else "-" for s in sources))
    return table


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from verl.trainer.eval_run import eval_config, resolve_source, run_eval

    ks, more = parse_ks(args.k)
    model, data, overrides = split_items([*args.items, *more])
    source = resolve_source(model)
    config, notes = eval_config(source, data, overrides, config_path=args.config, n=args.n, ks=ks,
                                temperature=args.temperature, batch_size=args.batch_size)
    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    what = f"{source.checkpoint} (step {source.step}, model.path {config.model.path})" if source.checkpoint else model
    err.print(f"verl eval: {what}", markup=False)
    for note in ([source.note] if source.note else []) + notes:
        err.print(f"note: {note}", markup=False)
    progress = Progress(TextColumn("sampling"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
                        TimeRemainingColumn(), console=err, transient=True)
    task: list[Any] = []

    def on_start(rows: int, report: Any) -> None:
        if report is not None:
            err.print(report.render(), markup=False)
        task.append(progress.add_task("sampling", total=rows))
        progress.start()

    try:
        result = run_eval(config, source, data=data, notes=notes, on_start=on_start,
                          progress=lambda done: progress.update(task[0], completed=done))
    finally:
        progress.stop()
    out.print(metrics_table(result))
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        err.print(f"wrote {path}", markup=False)
    return 0


def register(subparsers: Any) -> None:
    """Add `verl eval` to the `verl` parser."""
    p = subparsers.add_parser(
        "eval", help="pass@k, maj@k and mean@k of a model or checkpoint on a dataset.",
        description="Sample --n answers per prompt of DATA (files `verl train` reads; default: the config's "
        "validation rows, or the built-in arithmetic validation set) from MODEL (a checkpoint folder "
        "<run>/checkpoints/step_N, a run folder: its best checkpoint, else latest; a Hugging Face model folder or "
        "hub id; `tiny`), score them with the run's reward functions and print pass@k (unbiased, Chen et al. "
        "2021), maj@k (majority vote over the extracted answers) and mean@k, overall and per data_source. "
        "key=value overrides apply to the config (a checkpoint's own, else --config, else the defaults), e.g. "
        "reward.functions=[numeric_match] rollout.max_new_tokens=512.",
        epilog="example: verl eval runs/x/checkpoints/step_100 test.jsonl --n 8 --k 1 4 8 --out eval.json",
    )
    p.add_argument("items", nargs="*", metavar="MODEL [DATA] [key=value]",
                   help="the model or checkpoint, an optional data file, then dotted config overrides")
    p.add_argument("--n", type=int, default=None, help="answers sampled per prompt (rollout.val_n; default: the "
                   "config's)")
    p.add_argument("--k", nargs="+", default=None, metavar="K",
                   help="the k of pass@k, maj@k and mean@k, each <= n (rollout.val_k; default: n)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (rollout.val_temperature; default: the config's, 1.0 when n > 1 "
                   "and the config's is 0)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts sampled at once (data.val_batch_size)")
    p.add_argument("--config", default=None, metavar="CONFIG.yaml",
                   help="start from this config (model folders; a checkpoint brings its run's)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the metrics as JSON here")
    p.set_defaults(func=cmd_eval)


__all__ = ["cmd_eval", "metrics_table", "parse_ks", "register", "split_items"]
