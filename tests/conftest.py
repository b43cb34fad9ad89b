"""Suite-wide settings: one torch thread per process.

The models in the tests are tiny; on a 2-core machine several threads per process only fight each other
(and the multi-process tests), which made single forwards ~30x slower. Subprocesses inherit the env var.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub at test time: fail fast instead of retrying

import torch  # noqa: E402

torch.set_num_threads(1)
