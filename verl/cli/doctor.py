"""`verl doctor`: what this environment can run, and what to install for what it cannot."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import sys

from verl.errors import install_hint

# module -> how to install it and what it is for. Hints name the package itself (`verl` on the package
# index is another project), and the extra of a source checkout.
OPTIONAL = {
    "vllm": f"{install_hint('vllm', 'vllm')}  (fast GPU rollout, needs CUDA)",
    "ray": install_hint("ray", "ray"),
    "wandb": f"{install_hint('wandb', 'wandb')}  (logging.backends=[wandb])",
    "tensorboard": f"{install_hint('tensorboard', 'tensorboard')}  (logging.backends=[tensorboard])",
    "mlflow": f"{install_hint('mlflow', 'mlflow')}  (logging.backends=[mlflow])",
    "matplotlib": f"{install_hint('matplotlib', 'plot')}  (PNG from verl plot)",
    "peft": f"{install_hint('peft', 'peft')}  (LoRA: model.lora.rank > 0)",
    "math_verify": f"{install_hint('math-verify', 'math')}  (the math_verify reward)",
    "flash_attn": "pip install flash-attn --no-build-isolation  (CUDA only)",
    "trl": f"{install_hint('trl', 'bench')}  (benchmarks against TRL)",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_matmul_row() -> tuple[str, str, str]:
    """What `trainer.cpu_matmul=auto` picks here and why (measured once per host, `verl.utils.cpu_matmul`)."""
    from verl.utils.cpu_matmul import LIBRARY_NAMES, cpu_model, cpu_vendor, resolve

    library, why = resolve("auto")
    where = cpu_model() or cpu_vendor() or "unknown processor"
    return "cpu matmul", "ok", f"{where}: trainer.cpu_matmul=auto uses {LIBRARY_NAMES[library]} ({why})"


def collect() -> list[tuple[str, str, str]]:
    """(component, status, note) rows; status is 'ok', 'missing' or 'warn'."""
    import torch

    rows = [("python", "ok", sys.version.split()[0]), ("platform", "ok", platform.platform())]
    for dist in ("torch", "transformers", "tokenizers", "safetensors", "pydantic", "pyarrow"):
        version = _version(dist)
        rows.append((dist, "ok" if version else "missing", version or "pip install -e ."))
    rows.append(("cpu cores", "ok", str(os.cpu_count())))
    rows.append(_cpu_matmul_row())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            bf16 = "bf16" if torch.cuda.is_bf16_supported() else "no bf16"
            rows.append((f"cuda:{i}", "ok", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, {bf16}"))
        rows.append(("CUDA_VISIBLE_DEVICES", "ok", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset: all)")))
    else:
        rows.append(("cuda", "warn", "no GPU visible: training runs on CPU (gloo for multi-process)"))
    dist_ok = torch.distributed.is_available()
    rows.append(("torch.distributed", "ok" if dist_ok else "missing", "gloo" + (", nccl" if dist_ok and torch.distributed.is_nccl_available() else "")))
    for module, hint in OPTIONAL.items():
        found = importlib.util.find_spec(module) is not None
        rows.append((module, "ok" if found else "missing", _version(module.replace("_", "-")) or "" if found else hint))
    return rows


def run(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from verl.utils.console import plain_console

    table = Table(title="verl doctor")
    for col in ("component", "status", "details / fix"):
        table.add_column(col)
    style = {"ok": "green", "missing": "yellow", "warn": "yellow"}
    rows = collect()
    for name, status, note in rows:
        table.add_row(Text(name), Text(status, style=style[status]), Text(note))
    plain_console().print(table)
    required = {"torch", "transformers", "tokenizers", "safetensors", "pydantic", "pyarrow"}
    return 1 if any(name in required and status != "ok" for name, status, _ in rows) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="Show the environment: versions, devices, optional backends.",
        description="Check the Python environment, the visible devices and which optional backends are installed.",
    )
    parser.set_defaults(func=run)
