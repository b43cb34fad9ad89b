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


def vllm_rows() -> list[tuple[str, str, str]]:
    """Where vllm is installed: whether verl's vLLM engine supports its version
    (``verl.rollout.vllm_engine.VLLM_SUPPORTED``), and whether the installed torch and transformers satisfy
    the installed vLLM's own requirements (its distribution metadata, ``importlib.metadata.requires``). A
    vLLM wheel is built against one torch release: with another, it fails to import or crashes in its
    kernels, and pip does not always say so (an upgrade of torch after vLLM, or ``--no-deps``)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    from verl.rollout.vllm_engine import VLLM_SUPPORTED

    installed = _version("vllm")
    if installed is None:
        return []
    rows = []
    try:
        inside = SpecifierSet(VLLM_SUPPORTED).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        rows.append(("vllm version", "ok", f"vllm {installed} is in verl's supported range vllm{VLLM_SUPPORTED}"))
    else:
        rows.append(("vllm version", "warn",
                     f"vllm {installed} is outside the range verl's vLLM engine is written and tested against "
                     f"(vllm{VLLM_SUPPORTED}): it may lack or change an API the engine calls. Fix: pip install "
                     f"'vllm{VLLM_SUPPORTED}', or use rollout.engine=hf."))
    try:
        requirements = importlib.metadata.requires("vllm") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        if name not in ("torch", "transformers") or not str(req.specifier):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # for an extra of vLLM's, or another platform
        wanted = f"{name}{req.specifier}"
        have = _version(name)
        if have is None:
            rows.append((f"vllm needs {name}", "warn", f"vllm {installed} requires {wanted}, which is not "
                         f"installed. Fix: pip install '{wanted}'"))
            continue
        try:
            fits = req.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            fits = False
        if fits:
            rows.append((f"vllm needs {name}", "ok", f"{name} {have} satisfies vllm {installed}'s {wanted}"))
        else:
            rows.append((f"vllm needs {name}", "warn",
                         f"vllm {installed} requires {wanted}, but {name} {have} is installed: vLLM may fail "
                         f"to import or crash at run time. Fix: pip install '{wanted}', or install the vllm "
                         f"release built for {name} {have}."))
    return rows


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
    rows.append(("torch.distributed", "ok" if dist_ok else "missing",
                 "gloo" + (", nccl" if dist_ok and torch.distributed.is_nccl_available() else "")))
    for module, hint in OPTIONAL.items():
        found = importlib.util.find_spec(module) is not None
        rows.append((module, "ok" if found else "missing", _version(module.replace("_", "-")) or "" if found else hint))
    rows.extend(vllm_rows())
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
