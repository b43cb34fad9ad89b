"""`python -m verl.distributed.torchrun_quiet TORCHRUN_ARGS`: what `verl train --nproc N` launches.

torchrun itself, in this process, ending with exit code 1 (and no `ChildFailedError` traceback) when a
worker fails; see `verl.distributed.launch.run_torchrun_quietly`. A module of its own, so running it as
`__main__` does not re-import a module the package has already loaded.
"""

from __future__ import annotations

import sys

from verl.distributed.launch import run_torchrun_quietly

if __name__ == "__main__":
    sys.exit(run_torchrun_quietly(sys.argv[1:]))
