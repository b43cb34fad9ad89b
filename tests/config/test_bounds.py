"""Numbers a run cannot survive are refused when the config is read, naming the key; bad YAML bytes likewise."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl.config import load_config
from verl.config.loader import read_yaml
from verl.config.schema import MAX_SEED, MAX_THREADS, RunConfig
from verl.errors import ConfigError


@pytest.mark.parametrize(("override", "pattern"), [
    ("actor.lr=inf", r"actor\.lr: Input should be a finite number"),
    ("actor.lr=nan", r"actor\.lr: Input should be a finite number"),
    ("actor.kl_loss_coef=inf", r"actor\.kl_loss_coef: Input should be a finite number"),
    ("algorithm.kl_coef=.inf", r"algorithm\.kl_coef: Input should be a finite number"),
    ("reward.timeout_s=inf", r"reward\.timeout_s: Input should be a finite number"),
    ("trainer.seed=1e23", r"trainer\.seed: .*0 to 2\^63-1"),
    ("trainer.seed=-1", r"trainer\.seed: .*0 to 2\^63-1"),
    ("reward.workers=100000", r"reward\.workers: Input should be less than or equal to 1024"),
    ("env.agent_concurrency=100000", r"env\.agent_concurrency: Input should be less than or equal to 1024"),
    ("trainer.cpu_threads=100000", r"trainer\.cpu_threads: Input should be less than or equal to 1024"),
])
def test_a_number_no_run_survives_is_refused_naming_its_key(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_the_edges_of_the_ranges_are_accepted() -> None:
    config = load_config(None, [f"trainer.seed={MAX_SEED}", f"reward.workers={MAX_THREADS}", "trainer.seed=0"])
    assert config.trainer.seed == 0 and config.reward.workers == MAX_THREADS
    assert load_config(None, [f"trainer.seed={MAX_SEED}"]).trainer.seed == MAX_SEED


def test_every_section_refuses_inf_and_nan() -> None:
    """One rule for every float setting (the schema's sections share allow_inf_nan=False)."""
    def sections(model: type) -> list[type]:
        found = [model]
        for info in model.model_fields.values():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, RunConfig.__mro__[1]):
                found += sections(annotation)
        return found

    for section in sections(RunConfig):
        if section.__module__.startswith("verl.config."):  # the schema's sections, in modules by concept
            assert section.model_config.get("allow_inf_nan") is False, section.__name__


def test_invalid_utf8_in_a_yaml_file_names_the_file_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(b"trainer:\n  seed: 1\n  run_dir: \"ab\xff\xfe\"\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: not UTF-8 text: byte 33 \(0xff\).*save the file as UTF-8"):
        read_yaml(path)
    with pytest.raises(ConfigError, match=r"run\.yaml:3: not UTF-8"):
        load_config(path)


def test_a_utf8_bom_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xef\xbb\xbftrainer:\n  seed: 3\n")
    assert read_yaml(path) == {"trainer": {"seed": 3}}
