"""`python -m verl.trainer.main_ppo key=value ...`: volcengine/verl's command, answered with this verl's.

A volcengine/verl user starts RL with this module and Hydra overrides. Here a run starts with `verl train`
and keys of its own, so this prints the same run as a `verl train` command line, the settings whose
meaning differs (to decide) and those with nothing here, and exits without training: a run should start
from a command its user has read (`verl.config.verl_command`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from verl.config.verl_command import translate


def main(argv: Sequence[str] | None = None) -> int:
    translation = translate(sys.argv[1:] if argv is None else argv)
    lines = ["error: `python -m verl.trainer.main_ppo` is volcengine/verl's entry point; this verl trains with "
             "`verl train` and its own keys (docs/migrating.md). Nothing was started.",
             "", "The same run here:", f"  {translation.command()}"]
    if translation.decide:
        lines += ["", "Decide these (the meaning differs here):"]
        lines += [f"  {theirs}  ->  {ours}" for theirs, ours in translation.decide]
    if translation.missing:
        lines += ["", "No equivalent here (left out):"] + [f"  {item}" for item in translation.missing]
    lines += ["", "`verl check` with the same arguments runs every start-up check without training."]
    sys.stderr.write("\n".join(lines) + "\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
