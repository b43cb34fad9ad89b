"""`python -m verl.trainer.main_ppo key=value ...`: volcengine/verl's RL command, answered with this verl's.

A volcengine/verl user starts RL with this module and Hydra overrides. Here a run starts with `verl train`
and keys of its own, so this prints the same run as a `verl train` command line (stdout), the settings whose
meaning differs (to decide) and those with nothing here (stderr), and trains nothing: a run should start from a
command its user has read (`verl.compat.command`). It exits with `NOTHING_STARTED` (3), so a script or CI job
that ran it to train does not carry on as if it had; `verl compat ...` prints the same and exits 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from verl.compat.command import Translation, report, translate

NOTHING_STARTED = 3  # not 0: nothing trained; not 1 (an error) or 2 (a usage error): the answer was printed


def answer(module: str, translate_items: Callable[[Sequence[str]], Translation], argv: Sequence[str] | None) -> int:
    """Print the translation (once: under torchrun only rank 0 prints): the command on stdout, the notes on
    stderr. Exit `NOTHING_STARTED`: the command was volcengine/verl's to train, and nothing trained (`$(...)`
    still captures the command; `verl compat` is the way to ask for the translation alone, exit 0)."""
    if os.environ.get("RANK", "0") == "0":
        out, err = report(module, translate_items(sys.argv[1:] if argv is None else argv))
        sys.stderr.write(err)
        sys.stdout.write(out)
    return NOTHING_STARTED


def main(argv: Sequence[str] | None = None) -> int:
    return answer("verl.trainer.main_ppo", translate, argv)


if __name__ == "__main__":
    sys.exit(main())
