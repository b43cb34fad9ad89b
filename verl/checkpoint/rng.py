"""Every random-number generator a training step touches, captured as ``weights_only``-loadable data.

Bit-exact resume needs the python, numpy and torch (CPU and every CUDA device) generator states as they
were at the save. numpy's state holds an ndarray, which ``torch.load(weights_only=True)`` rightly refuses,
so it is stored as a tensor plus plain ints.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from verl.errors import CheckpointError


def capture_rng_state() -> dict[str, Any]:
    """The current RNG states of this process, as a dict of tensors, ints, floats and tuples."""
    py_version, py_internal, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)
    state: dict[str, Any] = {
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the states returned by :func:`capture_rng_state` (CUDA only if both sides have it)."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
        n = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": n["bit_generator"],
                "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                "has_gauss": n["has_gauss"],
                "gauss": n["gauss"],
            }
        )
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"saved RNG state is malformed ({type(exc).__name__}: {exc}); it must come from "
            "verl.checkpoint.capture_rng_state()."
        ) from exc
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        n_dev = torch.cuda.device_count()
        for i in range(min(len(saved), n_dev)):
            torch.cuda.set_rng_state(saved[i], device=i)
