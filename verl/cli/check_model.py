"""`verl check model NAME_OR_PATH [--tokenizer PATH]`: load a model the way training would and report.

`NAME_OR_PATH` is what `model.path` accepts, `tiny` specs included (built locally, offline). It runs the
same checks as the trainer's start-up (`verl.models.checks` via `load_hf_model_with_report`),
so a model that passes here loads in training, and one that fails here fails there with the same message.
"""

from __future__ import annotations

import argparse

from verl.errors import VerlError


def register_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `verl check model`'s arguments to ``parser``."""
    parser.add_argument("name_or_path", help="local model directory or Hugging Face model id")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path if it differs from the model")
    parser.add_argument("--dtype", default="fp32", help="dtype to load with (fp32, bf16, fp16)")
    parser.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                        help="allow the model's own Python code (off by default)")
    parser.add_argument("--chat", action="store_true", help="require a chat template (chat-formatted prompts)")
    parser.set_defaults(func=lambda args: run_check_model(args.name_or_path, tokenizer=args.tokenizer,
                                                          trust_remote_code=args.trust_remote_code,
                                                          dtype=args.dtype, chat=True if args.chat else None))


def print_report(console, report, *, problems: bool = True) -> None:
    """The load report as tables, then its warnings (and its problems, unless the caller lists them)."""
    from rich.table import Table
    from rich.text import Text

    from verl.utils.console import labelled

    # Text cells: token strings such as '[INST]' are shown as they are, on any console.
    table = Table(title="model load report", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in report.summary_rows():
        table.add_row(Text(key), Text(value))
    console.print(table)
    tokens = Table(title="special tokens")
    for col in ("role", "token", "id", "note"):
        tokens.add_column(col)
    for t in report.special_tokens:
        tokens.add_row(Text(t.role), Text(repr(t.token)) if t.token is not None else "-",
                       str(t.id) if t.id is not None else "-", Text(t.note))
    console.print(tokens)
    for w in report.warnings:
        console.print(labelled("warning: ", w, "yellow"))
    for p in report.problems if problems else ():
        console.print(labelled("problem: ", p, "red"))


def run_check_model(name_or_path: str, tokenizer: str | None = None, trust_remote_code: bool = False,
                    dtype: str = "fp32", *, chat: bool | None = None, console=None) -> int:
    """Print the load report and problems; return 0 if the model is usable, 1 otherwise."""
    from rich.text import Text

    from verl.models.hf_loader import load_hf_model_with_report
    from verl.trainer.build.models import resolve_model_path
    from verl.utils.console import labelled, plain_console

    console = console or plain_console()
    try:
        # `tiny[:arch[:hidden[:layers]]]` is built locally, exactly as model.path=tiny is: no hub, no network
        name_or_path = resolve_model_path(name_or_path)
        tokenizer = resolve_model_path(tokenizer) if tokenizer is not None else None
        _model, _tok, report = load_hf_model_with_report(
            name_or_path, tokenizer_name=tokenizer, torch_dtype=dtype, trust_remote_code=trust_remote_code,
            device="cpu", for_training=False, chat=chat,
            names={"tokenizer_name": "--tokenizer", "torch_dtype": "--dtype",
                   "trust_remote_code": "--trust-remote-code"})
    except VerlError as exc:
        console.print(labelled("problem: ", str(exc), "red"))
        return 1
    print_report(console, report)
    if report.problems:
        console.print(Text(f"{len(report.problems)} problem(s) found.", style="red"))
        return 1
    console.print(Text("model and tokenizer are consistent.", style="green"))
    return 0


__all__ = ["print_report", "register_arguments", "run_check_model"]
