"""`verl train` and `verl eval` keep transformers' logger lines, progress bars and FutureWarnings off the
console (they interleaved with the step lines); a user's TRANSFORMERS_VERBOSITY keeps them all."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging, warnings
from verl.cli.main import main
code = main(["train", "no_such_config.yaml"])
from transformers.utils import logging as hf_logging
hf_logging.get_logger("transformers.modeling_utils").warning("HF-LOGGER-LINE")
warnings.warn_explicit("HF-FUTURE-WARNING", FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
warnings.warn_explicit("OWN-FUTURE-WARNING", FutureWarning, "reward.py", 1, module="my_reward")
print("code", code, "bars", hf_logging.is_progress_bar_enabled())
"""


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env | env_extra,
                          timeout=120)


def test_verl_train_silences_the_hf_libraries_but_not_the_users_own_warnings():
    out = _run({})
    assert "code 1 bars False" in out.stdout, out.stderr
    assert "no_such_config.yaml" in out.stderr  # the run's own error still shows
    assert "HF-LOGGER-LINE" not in out.stderr and "HF-FUTURE-WARNING" not in out.stderr
    assert "OWN-FUTURE-WARNING" in out.stderr


def test_transformers_verbosity_set_by_the_user_keeps_them():
    out = _run({"TRANSFORMERS_VERBOSITY": "warning"})
    assert "code 1 bars True" in out.stdout, out.stderr
    assert "HF-LOGGER-LINE" in out.stderr and "HF-FUTURE-WARNING" in out.stderr
