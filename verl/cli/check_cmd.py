"""`verl check CONFIG.yaml`: the trainer's start-up pass without training, printed.

The checking itself is `verl.trainer.checks.preflight.preflight`, the function every trainer runs at start-up,
so a config passes here exactly when training would start; this module only chooses the world size and
device to check against and prints what the pass found. The world size is the one the same command line
would train on: `verl check cfg.yaml` checks one process, `verl check cfg.yaml --nproc 8` checks 8.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from rich.text import Text

from verl.cli.check_model import print_report
from verl.config.schema import RunConfig
from verl.distributed.memory_plan import GIB, plan_memory, suggestions
from verl.trainer.checks.preflight import Preflight, preflight
from verl.utils.console import labelled, plain_console


def default_world_size(config: RunConfig) -> int:
    """The world `verl train` would have with the same command line: one process (or torchrun's WORLD_SIZE
    when run under it), not what devices.* would need; a mapping that needs more is reported, with the
    `--nproc` to launch. `config` is kept for callers that pass it."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_device_type(config: RunConfig) -> str:
    """The device the run would use: `trainer.device=cuda` is checked as the GPU run it names even on a machine
    without one (a login node checks what it will launch: GPUs that support bfloat16 assumed, see
    `FSDPConfig.mixed_dtypes`); `auto` is what this machine would pick."""
    if config.trainer.device.startswith("cuda"):
        return "cuda"
    return "cuda" if config.trainer.device == "auto" and torch.cuda.is_available() else "cpu"


def without_the_gpu(config: RunConfig) -> bool:
    """Whether a GPU run is checked on a machine that has no GPU (its dtypes and plan are then assumed)."""
    return check_device_type(config) == "cuda" and not torch.cuda.is_available()


def collect(config: RunConfig, *, nproc: int | None = None, nodes: int | None = None) -> Preflight:
    """The start-up pass for `config` on `nproc` processes in all over `nodes` nodes (default: the one
    `verl train` would start)."""
    return preflight(config, world_size=nproc or default_world_size(config), device_type=check_device_type(config),
                     nodes=nodes)


def plan_device_bytes(gpu_memory_gib: float | None) -> int | None:
    """The GPU memory to plan against: `--gpu-memory` (GiB, as torch reports a device's total memory), else
    this machine's first GPU, else unknown."""
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB)
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def print_memory_plan(console: Any, inputs: Any, device_bytes: int | None) -> None:
    """The per-GPU plan of both phases and, when it does not fit, the settings that do."""
    plan = plan_memory(inputs, device_bytes)
    console.print(plan.render())
    if plan.fits is False:
        console.print(labelled("warning: ", "the memory plan does not fit this GPU. Settings to try, each with its "
                               "peaks:", "yellow"))
        for fix in suggestions(inputs, device_bytes):
            console.print(f"  {fix}")


def run_checks(config: RunConfig, *, nproc: int | None = None, nodes: int | None = None,
               gpu_memory_gib: float | None = None) -> int:
    """Print every section of the start-up pass; 1 if anything would stop a real run, else 0.

    `gpu_memory_gib` sizes the GPU memory plan on a machine without the run's GPUs."""
    pf = collect(config, nproc=nproc, nodes=nodes)
    console = plain_console()  # every message, file name and row is printed verbatim

    def section(title: str) -> None:
        console.print()
        console.print(Text(title, style="bold"))

    def problems(*sections: str) -> int:
        found = [p for p in pf.problems if p.section in sections]
        for p in found:
            console.print(labelled("problem: ", p.message, "red"))
        return len(found)

    def warnings(*sections: str) -> None:
        for w in pf.warnings:
            if w.section in sections:
                console.print(labelled("warning: ", w.message, "yellow"))

    def skipped(name: str) -> None:
        if name in pf.skipped:
            console.print(f"skipped: {pf.skipped[name]}")

    how = "" if nproc else " (as `verl train` without --nproc; `--nproc N` checks a launch of N)"
    section(f"run: trainer.kind={pf.kind}, {pf.world_size} process(es){how}")
    if without_the_gpu(config):
        console.print(f"note: this machine has no GPU: checked as the trainer.device={config.trainer.device} run, "
                      "on GPUs assumed to support bfloat16 (compute capability 8.0+, e.g. A100, H100); "
                      "--gpu-memory GIB sizes the memory plan")
    report = pf.startup
    if report is not None:
        for role, plan in report.plans.items():
            console.print(f"batches ({role}): {plan.describe()}")
        if report.mapping is not None:
            console.print(report.mapping.render_table())
            for note in (*report.mapping.casts, *report.mapping.notes):
                console.print(f"note: {note}")
        for note in (*report.fsdp_notes, *report.rl_notes):
            console.print(f"note: {note}")
        if report.parameters is not None:
            console.print(report.parameters.describe())
        if report.memory is not None:
            console.print(report.memory.render_table())
        if report.plan_inputs is not None:
            print_memory_plan(console, report.plan_inputs, plan_device_bytes(gpu_memory_gib))
        for warning in report.memory_warnings:
            console.print(labelled("warning: ", warning, "yellow"))
    warnings("start-up")
    if problems("start-up"):
        console.print("start-up checks failed: nothing was loaded (the model is checked once these pass)")

    section("model and tokenizer")
    skipped("model")
    if pf.model_report is not None:
        print_report(console, pf.model_report, problems=False)
    warnings("model")
    if not problems("model") and pf.model_report is not None:
        console.print(Text("model and tokenizer are consistent (checked on the meta device: no weights read).",
                           style="green"))
        if pf.cpu_matmul is not None:
            console.print(pf.cpu_matmul)

    section("data")
    skipped("data")
    skipped("prompt lengths")
    if pf.data is not None:
        for name, data_report in pf.data.reports.items():
            console.print(f"{name}: {data_report.kept_rows}/{data_report.total_rows} rows kept")
            console.print(data_report.render())
    warnings("data")
    problems("data")

    if pf.kind == "rl":
        section(f"environment: {config.env.name}" if config.env.name else "rewards")
        if pf.reward_names:
            console.print(f"reward functions: {', '.join(pf.reward_names)}")
            r = config.reward
            console.print(f"reward calls: up to {r.workers} at once on "
                          f"{'worker processes' if r.executor == 'process' else 'threads'}"
                          f" (reward.executor={r.executor}), {r.timeout_s:g} s each at most"
                          + (", starting as rows finish generating" if r.overlap else ""))
        if pf.env is not None:
            console.print(f"{len(pf.env)} training prompts, {len(pf.env.val_rows())} validation prompts")
        warnings("environment", "rewards")
        problems("environment", "rewards")

    console.print()
    if pf.problems:
        console.print(Text(f"{len(pf.problems)} check(s) failed", style="bold red"))
        return 1
    console.print(Text("all checks passed", style="bold green"))
    return 0


__all__ = ["check_device_type", "collect", "without_the_gpu", "default_world_size", "run_checks"]
