"""`torchrun -m verl.trainer.fsdp_sft_trainer key=value ...`: volcengine/verl's SFT command, answered with
this verl's `verl train trainer.kind=sft ...` command line (see `verl.compat.main_ppo`). Starts nothing."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from verl.compat.command import translate_sft
from verl.compat.main_ppo import answer


def main(argv: Sequence[str] | None = None) -> int:
    return answer("verl.trainer.fsdp_sft_trainer", translate_sft, argv)


if __name__ == "__main__":
    sys.exit(main())
