"""`torchrun -m verl.trainer.fsdp_sft_trainer ...` keeps working at volcengine/verl's path; what it does lives
in `verl.compat.fsdp_sft_trainer`."""

import sys

from verl.compat.fsdp_sft_trainer import main

if __name__ == "__main__":
    sys.exit(main())
