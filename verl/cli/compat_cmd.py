"""`verl compat COMMAND LINE`: a volcengine/verl launch line, as its scripts write it, translated to ours.

Upstream's DAPO recipe runs `ray job submit ... -- python3 -m recipe.dapo.main_dapo key=value ...`. This verl
ships no top-level `recipe` package: that generic name in site-packages would shadow, or be shadowed by, a
user's own `recipe` (or the verl-recipe checkout) depending on sys.path order, and those scripts start it
through Ray anyway. Prefixing the launch line with `verl compat` is the one edit: whatever launcher precedes
`-m MODULE` is skipped, and the answer is the same as `python -m verl.trainer.main_ppo`'s: the `verl train`
command on stdout (exit 0), a `#` line with the run sized for this CPU, and the notes on stderr.
"""

from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from verl.compat.command import report, translate_command

    module, translation = translate_command(args.command_line)
    out, err = report(module, translation)
    sys.stderr.write(err)
    sys.stdout.write(out)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compat", help="Translate a volcengine/verl command line (main_ppo, DAPO's main_dapo, SFT) to `verl train`.",
        description="Print the `verl train` command for a volcengine/verl launch line, given as its script writes "
        "it (a launcher such as `ray job submit ... --` before `-m MODULE` is skipped; without -m the items are "
        "main_ppo's). Starts nothing.",
        epilog="example: verl compat python3 -m recipe.dapo.main_dapo data.train_files=train.parquet "
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B",
    )
    parser.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND LINE",
                        help="the upstream launch line or its key=value items")
    parser.set_defaults(func=run)
