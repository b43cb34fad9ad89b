"""`verl data check|normalize`: look at a dataset the way the trainer will, before spending GPU hours.

Exit codes are for scripts: 0 every row is usable, 1 some rows are bad (or none exist), 2 the file (or
an argument) cannot be used at all. Torch is never imported, so this starts fast and stays small.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from verl.errors import ConfigError, ModelError, VerlError

EXIT_CLEAN, EXIT_BAD_ROWS, EXIT_UNREADABLE = 0, 1, 2


def parse_maps(items: list[str] | None) -> dict[str, str]:
    """`--map input=question --map ground_truth=reward_model.ground_truth` -> dict."""
    out: dict[str, str] = {}
    for item in items or []:
        field, sep, src = item.partition("=")
        if not sep or not field.strip() or not src.strip():
            raise ConfigError(f"--map {item!r}: write FIELD=SOURCE_KEY, e.g. --map input=question")
        out[field.strip()] = src.strip()
    return out


def load_tokenizer(path: str | None) -> Any:
    """A local tokenizer (never downloads, never runs repository code)."""
    if path is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError/... for a bad folder
        raise ModelError(
            f"--tokenizer {path}: cannot load a tokenizer from there ({e}); pass a local folder "
            "that holds tokenizer.json or tokenizer_config.json"
        ) from None


def print_report(report: Any, as_json: bool, out_path: str | None = None) -> None:
    """The report as DataReport.render() text, the same the trainer prints (or JSON for scripts)."""
    if as_json:
        d = report.to_dict()
        if out_path is not None:
            d["output"] = out_path
        print(json.dumps(d, ensure_ascii=False, indent=2))
        return
    status = "clean" if report.is_clean else "not clean"
    lines = [report.render(), f"status: {status}"]
    if out_path is not None:
        lines.append(f"wrote {report.kept_rows} rows to {out_path}" if report.kept_rows else "nothing written")
    print("\n".join(lines))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", required=True, choices=["prompt", "sft", "preference"], help="dataset kind")
    p.add_argument(
        "--map",
        action="append",
        metavar="FIELD=KEY",
        default=[],
        help="map a source key or dotted path to a field (repeatable), e.g. --map input=question",
    )
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder, for token-length statistics")
    p.add_argument("--max-prompt-length", type=int, default=None, help="count prompts longer than this")
    p.add_argument(
        "--truncation",
        choices=["error", "drop", "truncate_left"],
        default="error",
        help="what the trainer will do with prompts over --max-prompt-length",
    )
    p.add_argument(
        "--chat-template",
        choices=["auto", "always", "never"],
        default="auto",
        help="auto: template chat messages only; always: plain strings too",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def cmd_check(args: argparse.Namespace) -> int:
    from verl.data.load import iter_rows
    from verl.data.report import DataReport, GroundTruthGaps

    if args.require_ground_truth and args.kind != "prompt":
        raise ConfigError(f"--require-ground-truth checks prompt rows (a reward's ground truth), not --kind "
                          f"{args.kind} rows. Fix: drop it, or check the RL data with --kind prompt")
    tokenizer = load_tokenizer(args.tokenizer)
    report = DataReport(args.kind)
    gaps = GroundTruthGaps(required=args.require_ground_truth)
    for row in iter_rows(
        args.files,
        args.kind,
        report=report,
        fields=parse_maps(args.map),
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
        truncation=args.truncation,
        apply_chat_template=args.chat_template,
    ):
        if args.kind == "prompt":
            gaps.add(row)
    gaps.report(report)
    print_report(report, args.json)
    return EXIT_CLEAN if report.is_clean else EXIT_BAD_ROWS


def cmd_normalize(args: argparse.Namespace) -> int:
    from verl.data.load import normalize_files

    tokenizer = load_tokenizer(args.tokenizer)
    report = normalize_files(
        args.input,
        args.output,
        args.kind,
        fields=parse_maps(args.map),
        on_bad_row=args.on_bad_row,
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
        truncation=args.truncation,
        apply_chat_template=args.chat_template,
    )
    written = (
        Path(args.output).exists() and report.kept_rows > 0 and (args.on_bad_row == "skip" or report.is_clean)
    )
    report_path = Path(str(args.output) + ".report.json")
    d = report.to_dict()
    d["output"] = str(args.output) if written else None
    report_path.write_text(json.dumps(d, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    print_report(report, args.json, str(args.output) if written else None)
    if not written and not args.json:
        print(
            f"{args.output} was not written (bad rows with --on-bad-row error, or no usable row)",
            file=sys.stderr,
        )
    return EXIT_CLEAN if report.is_clean else EXIT_BAD_ROWS


def _guard(func: Any) -> Any:
    """Unreadable input or a bad argument is exit 2 with the message, never a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except VerlError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_UNREADABLE

    return run


def register(subparsers: Any) -> None:
    """Add `verl data check|normalize` to the `verl` command."""
    data = subparsers.add_parser(
        "data",
        help="Check or normalise a dataset file.",
        description="Validate a dataset the way the trainer reads it, or rewrite it in "
        "canonical JSONL. Exit codes: 0 clean, 1 bad rows, 2 unreadable.",
    )
    sub = data.add_subparsers(dest="data_command", metavar="{check,normalize}", required=True)
    check = sub.add_parser(
        "check",
        help="Report every row that would be dropped, and why.",
        epilog="example: verl data check train.jsonl --kind sft --map input=question",
    )
    check.add_argument(
        "files", nargs="+", metavar="FILE", help=".jsonl/.json/.parquet/.csv files or directories"
    )
    check.add_argument(
        "--require-ground-truth", action="store_true",
        help="--kind prompt: every row needs a ground truth (the reward reads one), even when no row has one",
    )
    _common(check)
    check.set_defaults(func=_guard(cmd_check))
    norm = sub.add_parser(
        "normalize",
        help="Write canonical JSONL plus the report (never overwrites the input).",
        epilog="example: verl data normalize raw.csv clean.jsonl --kind prompt --map prompt=q",
    )
    norm.add_argument("input", metavar="IN", help="input file or directory")
    norm.add_argument("output", metavar="OUT", help="output .jsonl (the report goes to OUT.report.json)")
    norm.add_argument(
        "--on-bad-row",
        choices=["skip", "error"],
        default="skip",
        help="skip: write the good rows (default); error: write nothing if any row is bad",
    )
    _common(norm)
    norm.set_defaults(func=_guard(cmd_normalize))


def main(argv: list[str] | None = None) -> int:
    """`python -m verl.cli.data_cmd ...`, for benchmarks and for use without the `verl` entry point."""
    parser = argparse.ArgumentParser(prog="verl")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
