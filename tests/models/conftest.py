"""Shared tiny models: built once per session (and cached on disk under $VERL_CACHE_DIR/tiny)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from verl.models.tiny import build_tiny_model, build_tiny_reward_model


@pytest.fixture(scope="session")
def instruct_path() -> str:
    return build_tiny_model()


@pytest.fixture(scope="session")
def base_path() -> str:
    return build_tiny_model(variant="base")


@pytest.fixture(scope="session")
def llama_path() -> str:
    return build_tiny_model(arch="llama")


@pytest.fixture(scope="session")
def reward_path() -> str:
    return build_tiny_reward_model()


@pytest.fixture
def edited_copy(tmp_path: Path):
    """Copy a tiny model directory and set keys of one of its JSON files (None writes null)."""

    def make(src: str, file: str, name: str = "edited", **changes) -> str:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        path = dst / file
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))
        return str(dst)

    return make
