"""`python -m verl.trainer.main_ppo ...` keeps working at volcengine/verl's path; what it does (print the same
run as a `verl train` command) lives with the rest of the compatibility layer, in `verl.compat.main_ppo`."""

import sys

from verl.compat.main_ppo import main

if __name__ == "__main__":
    sys.exit(main())
