"""`verl ckpt list|verify|export`: look at checkpoints without writing Python.

`verify` re-hashes every byte and exits 1 naming each bad file, so it can gate a copy to cold storage;
`export` turns a checkpoint into a Hugging Face folder that `from_pretrained` loads.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from verl.errors import CheckpointError


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def cmd_list(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verl.checkpoint import list_checkpoints

    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        raise CheckpointError(f"{run_dir}: no such run folder; pass the run's output_dir.")
    infos = list_checkpoints(run_dir, verify_files=not args.no_verify)
    if not infos:
        print(f"no checkpoints under {run_dir}")
        return 0
    rows = [("step", "verified", "size", "created", "latest", "best", "path")]
    for i in infos:
        status = "-" if i.problems is None else ("yes" if i.verified else "NO")
        best = f"* {i.best.describe()}" if i.best is not None else ""
        rows.append((str(i.step), status, _human(i.size_bytes), i.created or "?", "*" if i.is_latest else "", best,
                     str(i.path)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    bad = [i for i in infos if i.problems]
    for i in bad:
        for p in i.problems or []:
            print(f"step {i.step}: {p}", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from verl.checkpoint import verify

    problems = verify(args.path)
    if problems:
        print(f"{args.path}: FAILED ({len(problems)} problem{'s' if len(problems) > 1 else ''})", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"{args.path}: OK (every file matches manifest.json)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from verl.checkpoint import export_hf
    from verl.utils.dtype import resolve_dtype

    dtype: Any = None
    if args.dtype:
        dtype = resolve_dtype(args.dtype, where="--dtype")
    out = export_hf(args.path, args.out, dtype=dtype, adapter=args.adapter, base=args.base)
    if args.adapter:
        print(f"exported the adapter of {args.path} -> {out} "
              f"(load with PeftModel.from_pretrained(base_model, '{out}'))")
    else:
        import json

        architectures = json.loads((out / "config.json").read_text(encoding="utf-8")).get("architectures") or []
        auto = ("AutoModelForSequenceClassification"
                if any(a.endswith("ForSequenceClassification") for a in architectures)
                else "AutoModelForCausalLM")
        print(f"exported {args.path} -> {out} (load with {auto}.from_pretrained('{out}'))")
    return 0


def register(subparsers: Any) -> None:
    """Add `verl ckpt ...` to the `verl` parser."""
    ckpt = subparsers.add_parser(
        "ckpt", help="List, verify or export checkpoints.",
        description="List, verify (re-hash) or export (to a Hugging Face folder) verl checkpoints.",
    )
    sub = ckpt.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    p = sub.add_parser("list", help="Table of a run's checkpoints: step, verified?, size, time, latest, best "
                       "(checkpoint.keep_best, with its metric's value).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--no-verify", action="store_true", help="skip re-hashing (fast listing)")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("verify", help="Re-hash every file; exit 1 naming each file that is wrong.")
    p.add_argument("path", metavar="PATH", help="a checkpoint folder, e.g. runs/x/checkpoints/step_100")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("export", help="Write a Hugging Face folder (safetensors + config + tokenizer).")
    p.add_argument("path", metavar="PATH", help="a checkpoint folder")
    p.add_argument("--out", required=True, metavar="DIR", help="new folder to write")
    p.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16); default: as saved")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA checkpoints: write the peft adapter folder instead of merged weights")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="LoRA checkpoints: the base model, when not where training loaded it from")
    p.set_defaults(func=cmd_export)
