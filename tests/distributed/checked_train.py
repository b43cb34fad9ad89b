"""`verl train CONFIG` under the collective device check (run under torchrun by test_collective_devices.py).

The process is told it runs on the marker device (`collective_check.MARKER`) where torchrun's env would
give it its GPU; every collective verl calls must then get tensors made there. Each rank writes what the
check found to `collectives_rank<R>.json` beside the config."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collective_check import MARKER, check_collective_devices  # noqa: E402

import verl.trainer.build.setup as setup  # noqa: E402
from verl.config import load_config  # noqa: E402
from verl.distributed.process import init_distributed, shutdown_distributed  # noqa: E402
from verl.trainer.rl_trainer import RLTrainer  # noqa: E402


def on_marker(*args, **kwargs):
    return dataclasses.replace(init_distributed(*args, **kwargs), device=MARKER)


if __name__ == "__main__":
    setup.init_distributed = on_marker
    config = Path(sys.argv[1])
    try:
        with check_collective_devices() as check:
            trainer = RLTrainer(load_config(str(config)))
            assert trainer.parts.process.device == MARKER
            trainer.fit()
        (config.parent / f"collectives_rank{os.environ['RANK']}.json").write_text(
            json.dumps({"checked": check.checked, "violations": sorted(set(check.violations))}))
    finally:
        shutdown_distributed()
