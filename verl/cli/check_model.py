"""`verl check model NAME_OR_PATH [--tokenizer PATH]`: load a model the way training would and report.

The command only parses arguments; the load-and-report routine is `verl.models.check_model.run_check_model`,
which `verl check CONFIG` runs too.
"""

from __future__ import annotations

import argparse

from verl.models.check_model import run_check_model


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


__all__ = ["register_arguments", "run_check_model"]
