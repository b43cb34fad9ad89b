"""Migration papercuts (issue 45 item 9): the entry point's exit status, the CPU line of a sequence-parallel
script, and verl's run length in epochs."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from verl.compat.command import count_rows, cpu_command, report, translate
from verl.config import load_config

ARR = "actor_rollout_ref"

# the sizes of verl's DAPO Qwen2.5-7B script (recipe/dapo/run_dapo_qwen2.5_7b_...sh), shortened
DAPO_7B = [
    "data.train_files=dapo-math-17k.parquet", "data.max_prompt_length=2048", "data.max_response_length=20480",
    "data.train_batch_size=512", f"{ARR}.model.path=Qwen/Qwen2.5-Math-7B", f"{ARR}.rollout.n=16",
    f"{ARR}.actor.ulysses_sequence_parallel_size=4", f"{ARR}.actor.ppo_max_token_len_per_gpu=22528",
    f"{ARR}.actor.use_dynamic_bsz=True", f"{ARR}.rollout.name=vllm", "trainer.n_gpus_per_node=8",
    "trainer.nnodes=4", "custom_reward_function.path=reward.py",
]


def test_python_m_main_ppo_exits_non_zero_since_it_starts_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", f"{ARR}.model.path=tiny"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("verl train model.path=tiny") and "Nothing was started" in done.stderr


def test_the_cpu_line_of_a_sequence_parallel_script_runs_one_process_with_a_note() -> None:
    t = translate(DAPO_7B)
    assert "actor.sequence_parallel_size=4" in t.ours  # the run's own line keeps the split
    words = shlex.split(cpu_command(t))
    items = dict(w.split("=", 1) for w in words[4:])
    assert words[2:4] == ["--nproc", "1"] and items["actor.sequence_parallel_size"] == "1"
    assert load_config(None, words[4:]).actor.sequence_parallel_size == 1
    _, err = report("recipe.dapo.main_dapo", t)
    assert "The CPU line runs actor.sequence_parallel_size=1 (the run's own line keeps 4)" in err
    plain = translate([f"{ARR}.model.path=tiny"])
    assert "sequence_parallel_size" not in cpu_command(plain) and "sequence_parallel" not in report("m", plain)[1]


def test_total_epochs_is_epochs_times_steps_per_epoch_where_the_rows_can_be_counted(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(50)))
    t = translate([f"data.train_files={data}", "data.train_batch_size=8", "trainer.total_epochs=3",
                   f"{ARR}.actor.optim.lr_warmup_steps_ratio=0.1"])
    ours = dict(item.split("=", 1) for item in t.ours)
    assert ours["trainer.total_steps"] == "18"  # 3 x (50 // 8): verl's dataloader drops the partial batch
    assert ours["actor.warmup_steps"] == "1"  # the ratio of those 18 steps
    assert ("trainer.total_epochs=3", "trainer.total_steps=18: 3 epochs x (50 rows in data.train_files // "
            "data.train_batch_size=8), verl's count of steps") in t.notes
    assert not [theirs for theirs, _ in t.decide if "total_epochs" in theirs]
    # verl's own total_training_steps wins over epochs, as it does there
    assert "trainer.total_steps=7" in translate([f"data.train_files={data}", "trainer.total_epochs=3",
                                                 "trainer.total_training_steps=7"]).ours


def test_total_epochs_of_files_not_here_is_to_decide_with_the_count_to_make() -> None:
    t = translate(["data.train_files=~/data/gsm8k/train.parquet", "trainer.total_epochs=15"])
    decided = dict(t.decide)["trainer.total_epochs=15"]
    assert "15 epochs x (training rows // data.train_batch_size=1024)" in decided
    assert "train.parquet cannot be read here" in decided
    assert not [o for o in t.ours if o.startswith("trainer.total_steps=")]


def test_rows_are_counted_in_parquet_json_and_jsonl(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), tmp_path / "t.parquet")
    (tmp_path / "t.json").write_text(json.dumps([{"p": 1}, {"p": 2}]))
    (tmp_path / "t.jsonl").write_text('{"p": 1}\n\n{"p": 2}\n')
    assert [count_rows(str(tmp_path / f"t.{ext}")) for ext in ("parquet", "json", "jsonl")] == [3, 2, 2]
    assert count_rows(str(tmp_path / "missing.parquet")) is None and count_rows(str(tmp_path / "t.csv")) is None


def test_total_epochs_of_fewer_rows_than_one_batch_is_to_decide(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "q"}\n' * 3)
    t = translate([f"data.train_files={data}", "data.train_batch_size=8", "trainer.total_epochs=2"])
    assert "holds 3 rows, fewer than one batch" in dict(t.decide)["trainer.total_epochs=2"]
