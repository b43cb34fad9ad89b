"""The RL trainer on a data.mixture, a save_to_disk folder and a Python `datasets.Dataset`: per-source reward
metrics over the global batch, the mixture's prompt order resumed exactly from a checkpoint, and bad rows of a
Python dataset named by their index."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from rl_support import DIGIT_REWARD_SPEC, read_metrics
from tiny_support import tiny_run_config

from verl.errors import DataError
from verl.trainer.rl_trainer import RLTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from hf_support import FakeDataset, save_to_disk  # noqa: E402

SMALL = ["data.train_batch_size=4", "rollout.n=2", "rollout.max_new_tokens=3"]


def _rows(n: int, tag: str, source: str | None = None) -> list[dict]:
    return [{"prompt": f"{tag} {i}+1=", "answer": str(i + 1), **({"data_source": source} if source else {})}
            for i in range(n)]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(run_dir: Path, *overrides: str, tree: dict | None = None):
    config = tiny_run_config(run_dir, *SMALL, *overrides)
    if tree:
        for key, value in tree.items():
            setattr(config.data, key, value)
    config.reward.functions = [dict(DIGIT_REWARD_SPEC)]
    return config


def _mixture(tmp_path: Path) -> list[dict]:
    return [{"name": "math", "files": [_jsonl(tmp_path / "math.jsonl", _rows(12, "m"))], "weight": 0.75},
            {"name": "code", "files": [str(save_to_disk(tmp_path / "code_hf", _rows(4, "c")))], "weight": 0.25}]


def test_a_mixture_step_logs_each_source(tmp_path: Path) -> None:
    trainer = RLTrainer(_config(tmp_path / "run", "trainer.total_steps=1", tree={"mixture": _mixture(tmp_path)}))
    metrics = trainer.step()
    shares = {k: v for k, v in metrics.items() if k.startswith("mixture/")}
    assert set(shares) == {"mixture/math/share", "mixture/code/share"} and sum(shares.values()) == pytest.approx(1.0)
    assert trainer.env._order.quotas == [12, 4]  # each epoch of 16 prompts: exactly 3:1
    means = [metrics[f"reward/mean/{s}"] for s in ("math", "code") if f"reward/mean/{s}" in metrics]
    total = sum(metrics[f"reward/mean/{s}"] * shares[f"mixture/{s}/share"] for s in ("math", "code")
                if f"reward/mean/{s}" in metrics)
    assert means and total == pytest.approx(metrics["reward/mean"], abs=1e-6)


def test_rows_of_several_data_sources_log_each_source(tmp_path: Path) -> None:
    files = [_jsonl(tmp_path / "a.jsonl", _rows(4, "a", "gsm8k") + _rows(4, "b", "math"))]
    trainer = RLTrainer(_config(tmp_path / "run", "trainer.total_steps=1", tree={"train_files": files}))
    assert trainer.env.metric_sources == ("data_source", ["gsm8k", "math"])
    metrics = trainer.step()
    assert {k for k in metrics if k.startswith("reward/mean/")} <= {"reward/mean/gsm8k", "reward/mean/math"}
    assert not any(k.startswith("mixture/") for k in metrics)


def test_a_python_dataset_and_a_folder_train_like_files(tmp_path: Path) -> None:
    overrides = {"trainer.device": "cpu", "trainer.run_dir": str(tmp_path / "run"), "model.dtype": "float32",
                 "data.train_batch_size": 2, "rollout.n": 2, "rollout.max_new_tokens": 2, "logging.backends": ["jsonl"],
                 "trainer.val_before_train": False, "trainer.total_steps": 1}
    dataset = FakeDataset(_rows(6, "q"))
    trainer = RLTrainer.from_pretrained("tiny", reward_fn="numeric_match", dataset={"train": dataset}, **overrides)
    reads = dataset.reads
    assert len(trainer.env) == 6 and "reward/mean" in trainer.step()
    assert dataset.reads == reads + 2  # the step read its two prompts from the dataset, nothing else
    bad = FakeDataset([*_rows(2, "q"), {"prompt": None}])
    with pytest.raises(DataError, match=r"dataset\[2\]: 'prompt' is null"):
        RLTrainer.from_pretrained("tiny", reward_fn="numeric_match", dataset=bad, **overrides)
    folder = save_to_disk(tmp_path / "hf", _rows(6, "q"))
    trainer = RLTrainer.from_pretrained("tiny", reward_fn="numeric_match", dataset=str(folder), **overrides)
    assert len(trainer.env) == 6 and trainer.config.data.train_files == [str(folder)]


def test_a_mixture_resumes_its_prompt_order_exactly(tmp_path: Path) -> None:
    mixture = _mixture(tmp_path)

    def run(run_dir: Path, *overrides: str) -> tuple[RLTrainer, list[list[str]]]:
        trainer = RLTrainer(_config(run_dir, *overrides, tree={"mixture": mixture}))
        drawn: list[list[str]] = []
        get_batch = trainer.env.get_batch

        def recording(n: int) -> list[dict]:
            rows = get_batch(n)
            drawn.append([r["prompt"] for r in rows])
            return rows

        trainer.env.get_batch = recording
        trainer.fit()
        return trainer, drawn

    straight, expected = run(tmp_path / "straight", "trainer.total_steps=5")
    run(tmp_path / "cut", "trainer.total_steps=2", "checkpoint.save_interval=2")
    resumed, rest = run(tmp_path / "cut", "trainer.total_steps=5", "trainer.resume=auto")
    assert rest == expected[2:] and resumed.env.state_dict() == straight.env.state_dict()
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == [1, 2, 3, 4, 5]
