"""`verl check CONFIG.yaml`: every start-up validation the trainer runs, without training.

It calls the same functions as the trainer's start-up (`validate_startup`, the model load report, the
data report), prints what each found, and exits 1 if anything would stop a real run.
"""

from __future__ import annotations

from pathlib import Path

from verl.config.schema import RunConfig
from verl.errors import VerlError


def default_world_size(config: RunConfig) -> int:
    """The world `verl train` would most likely be launched with, for checking a mapping offline."""
    d = config.devices
    listed = [r for ranks in (d.actor, d.critic, d.ref, d.reward) if ranks for r in ranks]
    return max([d.num_gpus_per_node or 1, *(r + 1 for r in listed)])


def run_checks(config: RunConfig, *, nproc: int | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    from verl.models.check_model import run_check_model
    from verl.trainer.runtime import resolve_model_path
    from verl.trainer.startup import validate_startup

    console = Console(soft_wrap=True)
    world = nproc or default_world_size(config)
    failures = 0

    def section(title: str) -> None:
        console.print(f"\n[bold]{title}[/]", markup=True)

    def problem(text: str) -> None:
        nonlocal failures
        failures += 1
        console.print(f"[red]problem:[/] {escape(text)}", markup=True, highlight=False)

    section(f"run: trainer.kind={config.trainer.kind}, {world} process(es)")
    model_path = None
    try:
        model_path = resolve_model_path(config.model.path)
    except VerlError as exc:
        problem(str(exc))
    try:
        report = validate_startup(config, world_size=world, model_path=model_path)
    except VerlError as exc:
        problem(str(exc))
        report = None
    if report is not None:
        for role, plan in report.plans.items():
            console.print(f"batches ({role}): {plan.describe()}", highlight=False)
        console.print(report.mapping.render_table(), highlight=False)
        for note in (*report.mapping.casts, *report.mapping.notes, *report.fsdp_notes):
            console.print(f"note: {escape(note)}", markup=True, highlight=False)
        if report.memory is not None:
            console.print(report.memory.render_table(), highlight=False)
        for warning in report.memory_warnings:
            console.print(f"[yellow]warning:[/] {escape(warning)}", markup=True, highlight=False)

    section("model and tokenizer")
    if model_path is not None:
        if not Path(model_path).expanduser().exists() and model_path.startswith(("/", ".", "~")):
            problem(f"model.path={model_path} does not exist on this machine; download the model there or fix "
                    "the path (everything else above was checked without it)")
        else:
            dtype = "float32" if config.model.dtype == "auto" else config.model.dtype
            if run_check_model(model_path, tokenizer=config.model.tokenizer_path, dtype=dtype,
                               trust_remote_code=config.model.trust_remote_code, console=console):
                failures += 1

    if config.env.name is None:
        section("data")
        _check_data(config, console, problem)
    else:
        section(f"environment: {config.env.name}")
        try:
            from verl.env import build_env

            env = build_env(config.env, reward_functions=config.reward.functions, base_dir=config._source_dir,
                            seed=config.trainer.seed)
            console.print(f"{len(env)} training prompts, {len(env.val_rows())} validation prompts", highlight=False)
        except VerlError as exc:
            problem(str(exc))
    if config.trainer.kind == "rl" and config.env.name is None:
        section("rewards")
        try:
            from verl.rewards import RewardManager

            manager = RewardManager(config.reward.functions, base_dir=config._source_dir)
            console.print(f"reward functions: {', '.join(manager.names)}", highlight=False)
        except VerlError as exc:
            problem(str(exc))
    console.print()
    if failures:
        console.print(f"[bold red]{failures} check(s) failed[/]", markup=True)
        return 1
    console.print("[bold green]all checks passed[/]", markup=True)
    return 0


def _check_data(config: RunConfig, console, problem) -> None:
    from verl.data import load_rows

    d = config.data
    if not d.train_files:
        problem("data.train_files is empty; set it to your JSONL/JSON/Parquet/CSV file(s)")
        return
    for name, files in (("train", d.train_files), ("val", d.val_files)):
        if not files:
            continue
        try:
            _rows, report = load_rows([config.resolve_path(f) for f in files], d.kind, fields=d.fields or None, on_bad_row=d.on_bad_row)
            console.print(f"{name}: {report.kept_rows}/{report.total_rows} rows kept", highlight=False)
            console.print(report.render(), highlight=False, markup=False)
        except VerlError as exc:
            problem(f"{name} data: {exc}")
