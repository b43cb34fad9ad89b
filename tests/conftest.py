"""Suite-wide settings (one torch thread per process, no model hub) and the shared tiny-model fixtures.

The models in the tests are tiny; on a 2-core machine several threads per process only fight each other
(and the multi-process tests), which made single forwards ~30x slower. Subprocesses inherit the env var.

The config builders for tiny runs are in tests/tiny_support.py (`from tiny_support import ...`: pytest puts
this folder on sys.path).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub at test time: fail fast instead of retrying

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_path() -> str:
    """The folder of the tiny model that `model.path=tiny` names (built once, cached on disk)."""
    from verl.models.tiny import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): the tiny instruct model in float32 on the CPU, as training loads it. One per test
    module, not per session: modules change it in place (train/eval mode, sharpened weights, tokenizer
    settings); tests that train take a `copy.deepcopy`. A module with another variant or tokenizer overrides
    this fixture with `tiny_support.load_tiny(...)`."""
    from tiny_support import load_tiny

    return load_tiny()
