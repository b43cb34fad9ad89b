"""Asynchronous RL on 2 gloo processes: rank 1 only generates (devices.rollout), rank 0 trains.

With rollout.max_staleness=0 the run is the synchronous one, exactly: the same samples and the same updates as
one process training alone (every metric of every step equal). With max_staleness=1 the rollout rank
samples batch i+1 while rank 0 trains on batch i: each batch is one update old, the correction weighs it,
and the run resumes from its checkpoint regenerating what was in flight."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
REWARD = HERE.parent / "trainer" / "rl_support.py"


def _config(tmp_path: Path, name: str, steps: int, *, rollout_rank: bool, k: int = 0, lora: bool = False) -> Path:
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 8}},
        "data": {"train_batch_size": 8, "max_prompt_length": 16},
        "rollout": {"n": 4, "max_new_tokens": 4, "max_staleness": k},
        "reward": {"functions": [{"name": f"{REWARD}:digit_reward"}]},
        "actor": {"lr": 1e-3, "micro_batch_size": 16},
        "trainer": {"total_steps": steps, "device": "cpu", "val_before_train": False, "cpu_threads": 1,
                    "run_dir": str(tmp_path / name)},
        "checkpoint": {"save_interval": 1},
        "logging": {"backends": ["jsonl"]},
    }
    if rollout_rank:
        cfg["devices"] = {"actor": [0], "rollout": [1]}
    if lora:
        cfg["model"]["lora"] = {"rank": 4}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "async/"))}


def test_staleness_zero_is_synchronous_training_exactly(tmp_path):
    verl_train(_config(tmp_path, "sync", 3, rollout_rank=False), tmp_path, nproc=1)
    verl_train(_config(tmp_path, "async", 3, rollout_rank=True, k=0), tmp_path, nproc=2)
    sync, async_ = metrics(tmp_path / "sync"), metrics(tmp_path / "async")
    assert [_numbers(r) for r in async_] == [_numbers(r) for r in sync]
    assert all(r["async/staleness"] == 0.0 for r in async_)
    assert all(r["actor/grad_norm"] > 0 for r in async_)


@pytest.mark.slow
def test_two_rollout_ranks_send_one_batch_of_their_shards(tmp_path):
    """Rollout ranks 1 and 2 each sample half of a batch, to their own longest response and prompt: padded to
    one width they arrive as the batch two data-parallel ranks would have sampled (their generators are
    seeded alike), so k = 0 scores what a 2-rank colocated run scores, step after step."""
    dp = yaml.safe_load(_config(tmp_path, "dp", 2, rollout_rank=False).read_text())
    # float64: step 2 samples from weights after an Adam step of a 2-rank and a 1-rank update; Adam divides each
    # gradient by its own size, so float32 rounding of a near-zero gradient becomes an lr-sized weight difference
    # that can change a sample (and the reward, compared to 1e-12); in float64 the updates agree to ~1e-16.
    dp["model"]["dtype"] = "float64"
    dp["env"]["kwargs"]["max_operand"] = 10  # "3+4=" or "10+4=": the two halves' prompts differ in width
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(dp))
    verl_train(tmp_path / "dp.yaml", tmp_path, nproc=2)
    split = dp | {"devices": {"actor": [0], "rollout": [1, 2]}}
    split["trainer"] = dp["trainer"] | {"run_dir": str(tmp_path / "split")}
    (tmp_path / "split.yaml").write_text(yaml.safe_dump(split))
    verl_train(tmp_path / "split.yaml", tmp_path, nproc=3)
    dp, rows = metrics(tmp_path / "dp"), metrics(tmp_path / "split")
    for key in ("response/length_mean", "response/length_max"):
        assert [r[key] for r in rows] == [r[key] for r in dp], key
    for key, tol in (("reward/mean", 1e-12), ("actor/pg_loss", 1e-5)):  # summed in another order
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in dp], rel=tol, abs=tol), key


def _with_dynamic_sampling(path: Path) -> Path:
    """DAPO's dynamic sampling on a reward that gives half the groups equal rewards: extra rounds every step."""
    cfg = yaml.safe_load(path.read_text())
    cfg["algorithm"] = {"filter_groups": True, "max_resample_rounds": 2}
    cfg["reward"] = {"functions": [{"name": f"{REWARD.parent / 'test_rl_dynamic_sampling.py'}:half_constant"}]}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dynamic_sampling_draws_its_extra_rounds_from_the_rollout_ranks(tmp_path, monkeypatch):
    """k = 0: the same extra rounds, samples and updates as one process; k = 1: the rounds come from the queue."""
    monkeypatch.syspath_prepend(str(REWARD.parent))  # the reward file imports rl_support (run alone, too)
    verl_train(_with_dynamic_sampling(_config(tmp_path, "sync", 2, rollout_rank=False)), tmp_path, nproc=1)
    verl_train(_with_dynamic_sampling(_config(tmp_path, "async", 2, rollout_rank=True, k=0)), tmp_path, nproc=2)
    sync, async_ = metrics(tmp_path / "sync"), metrics(tmp_path / "async")
    assert [_numbers(r) for r in async_] == [_numbers(r) for r in sync]
    assert all(r["dynamic_sampling/rounds"] >= 1 for r in sync)
    verl_train(_with_dynamic_sampling(_config(tmp_path, "ahead", 2, rollout_rank=True, k=1)), tmp_path, nproc=2)
    ahead = metrics(tmp_path / "ahead")
    assert all(r["dynamic_sampling/rounds"] >= 1 and r["async/staleness"] <= 1 for r in ahead)
    assert ahead[-1]["async/staleness"] == 1.0


def test_multi_turn_episodes_run_on_the_rollout_ranks(tmp_path):
    """The calculator environment's episodes (model turns, tool observations) on the rollout rank: with k = 0
    the same episodes, scores, metrics and updates as one process."""
    def calculator(path: Path) -> Path:
        cfg = yaml.safe_load(path.read_text())
        cfg["env"] = {"name": "calculator", "kwargs": {"digits_a": 2, "digits_b": 1, "num_train": 64, "num_val": 8,
                                                       "max_turns": 2, "max_episode_tokens": 24}}
        cfg["rollout"] |= {"stop": ["</calc>"], "max_new_tokens": 8}
        del cfg["reward"]
        path.write_text(yaml.safe_dump(cfg))
        return path

    verl_train(calculator(_config(tmp_path, "sync", 2, rollout_rank=False)), tmp_path, nproc=1)
    verl_train(calculator(_config(tmp_path, "async", 2, rollout_rank=True, k=0)), tmp_path, nproc=2)
    sync, async_ = metrics(tmp_path / "sync"), metrics(tmp_path / "async")
    assert [_numbers(r) for r in async_] == [_numbers(r) for r in sync]
    assert "episode/turns_mean" in async_[0] and "episode/tool_calls_mean" in async_[0]


def _weights(run_dir: Path, step: int) -> dict:
    """The policy's weights in the step's checkpoint, as one tensor each (`verl ckpt export`)."""
    from safetensors.torch import load_file

    from verl.checkpoint import export_hf

    return load_file(str(export_hf(run_dir / "checkpoints" / f"step_{step}", run_dir / "export") / "model.safetensors"))


def _tool_env(path: Path) -> Path:
    """A ToolEnv (tool_env_letters.py: the tool's results as the Hermes template's tool turn) on the tools model."""
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["path"] = "tiny:qwen2:64:2:tools"
    cfg["env"] = {"name": f"{HERE / 'tool_env_letters.py'}:Letters"}
    cfg["data"] |= {"train_batch_size": 4, "max_prompt_length": 160}
    cfg["rollout"] |= {"n": 2, "stop": ["e", "a"], "max_new_tokens": 6}
    cfg["actor"]["micro_batch_size"] = 8
    cfg["checkpoint"]["save_interval"] = 0  # the last step's only
    del cfg["reward"]
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_tool_env_episodes_run_on_the_rollout_ranks(tmp_path):
    """ToolEnv episodes (calls parsed in the environment's format, results in the chat template's tool turn) on
    the rollout rank: with k = 0 the same episodes, metrics and weights as one process; with k = 1 they are
    one update old from the second step on."""
    verl_train(_tool_env(_config(tmp_path, "sync", 2, rollout_rank=False)), tmp_path, nproc=1)
    verl_train(_tool_env(_config(tmp_path, "async", 2, rollout_rank=True, k=0)), tmp_path, nproc=2)
    sync, async_ = metrics(tmp_path / "sync"), metrics(tmp_path / "async")
    assert [_numbers(r) for r in async_] == [_numbers(r) for r in sync]
    assert all(r["episode/tool_calls_mean"] > 0 and r["actor/grad_norm"] > 0 for r in sync)
    one, two = _weights(tmp_path / "sync", 2), _weights(tmp_path / "async", 2)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    verl_train(_tool_env(_config(tmp_path, "ahead", 3, rollout_rank=True, k=1)), tmp_path, nproc=2)
    ahead = metrics(tmp_path / "ahead")
    assert [r["async/staleness"] for r in ahead] == [0.0, 1.0, 1.0]
    assert [r["async/version"] for r in ahead] == [0.0, 0.0, 1.0]
    assert ahead[-1]["async/staleness_tokens_1"] == 1.0 and ahead[-1]["rollout_corr/ratio_mean"] != 1.0


def _agent(path: Path, concurrency: int = 1) -> Path:
    """Agent episodes (agent_letters.py: two chat calls each, some failing, some scored by the environment),
    by default one at a time (env.agent_concurrency=1; see the test)."""
    cfg = yaml.safe_load(path.read_text())
    cfg["env"] |= {"agent": str(HERE / "agent_letters.py") + ":run", "agent_concurrency": concurrency}
    cfg["data"] |= {"train_batch_size": 4, "max_prompt_length": 64}
    cfg["rollout"] |= {"n": 2, "max_new_tokens": 5}
    cfg["actor"]["micro_batch_size"] = 8
    cfg["checkpoint"]["save_interval"] = 0
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_agent_episodes_run_on_the_rollout_ranks(tmp_path):
    """The agent's endpoint runs on the rollout rank; its episodes (stitched calls, log-probs, masks, the agent's
    rewards and the environment's, failed agents' tracebacks, the episode metrics) reach the actor rank.

    The agents' timing decides which of their calls the endpoint samples together, and so what the one random
    stream gives each call: with concurrent agents two runs (on one process or two) sample differently. One agent
    at a time (env.agent_concurrency=1) makes the calls' order, and so the samples, deterministic: then k = 0
    equals one process exactly (the same batches, text included, metrics and weights)."""
    script = HERE / "recording_train.py"
    verl_train(_agent(_config(tmp_path, "sync", 2, rollout_rank=False)), tmp_path, nproc=1, script=script)
    verl_train(_agent(_config(tmp_path, "async", 2, rollout_rank=True, k=0)), tmp_path, nproc=2, script=script)
    sync, async_ = metrics(tmp_path / "sync"), metrics(tmp_path / "async")
    assert [_numbers(r) for r in async_] == [_numbers(r) for r in sync]
    batches = [[json.loads(line) for line in (tmp_path / f"{name}.batches.jsonl").read_text().splitlines()]
               for name in ("sync", "async")]
    assert batches[0] == batches[1] and [b["step"] for b in batches[1]] == [1, 2]
    assert any("[agent failed]" in text and "the agent gives up" in text for b in batches[1] for text in b["responses"])
    assert all(r["episode/agent_calls"] > 1 and r["actor/grad_norm"] > 0 for r in sync)
    assert all(r["episode/agent_restarted_calls"] == 0 for r in sync)  # the calls were stitched into one sequence
    assert sum(r["episode/agent_failed"] for r in sync) > 0
    one, two = _weights(tmp_path / "sync", 2), _weights(tmp_path / "async", 2)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    # k = 1 with concurrent agents (their calls batched as they come): one update old from the second batch on
    verl_train(_agent(_config(tmp_path, "ahead", 3, rollout_rank=True, k=1), concurrency=8), tmp_path, nproc=2)
    ahead = metrics(tmp_path / "ahead")
    assert [r["async/staleness"] for r in ahead] == [0.0, 1.0, 1.0]
    assert [r["async/version"] for r in ahead] == [0.0, 0.0, 1.0]
    assert [r["async/staleness_tokens_1"] for r in ahead[1:]] == [1.0, 1.0]
    assert all(r["episode/agent_calls"] > 1 and r["episode/agent_restarted_calls"] == 0 for r in ahead)
    assert ahead[-1]["rollout_corr/ratio_mean"] != 1.0 and ahead[-1]["actor/grad_norm"] > 0


def test_one_step_off_policy_trains_corrects_and_resumes(tmp_path):
    """With a LoRA policy: only the adapters travel to the rollout rank."""
    verl_train(_config(tmp_path, "run", 2, rollout_rank=True, k=1, lora=True), tmp_path, nproc=2)
    rows = metrics(tmp_path / "run")
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0]  # the first batch: nothing to run ahead of
    assert rows[1]["rollout/logprob_diff_mean"] > 0  # sampled by the weights before the last update ...
    assert rows[1]["rollout_corr/ratio_mean"] != 1.0  # ... and weighed by the correction (auto: token_tis)
    assert {"async/queue_depth", "async/weight_delivery_s", "async/rollout_idle_frac",
            "async/trainer_idle_frac"} <= set(rows[1])
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_2" / "manifest.json").read_text())
    assert manifest["world_size"] == 2

    assert rows[1]["async/weight_delivery_mb"] < 0.1  # 4-rank adapters of a 172k-parameter model
    verl_train(_config(tmp_path, "run", 3, rollout_rank=True, k=1, lora=True), tmp_path, nproc=2)  # resume: step 3
    resumed = metrics(tmp_path / "run")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    # the batch in flight at the checkpoint was regenerated by the resumed weights: staleness 0, not lost
    assert resumed[-1]["async/staleness"] == 0.0 and resumed[-1]["actor/grad_norm"] > 0


def test_a_partial_rollout_finishes_its_responses_under_the_new_weights(tmp_path):
    """The rollout rank takes version 1 after token 2 of batch 2 (held there until the actor posts it): the
    batch's later tokens are version 1, so only its first two tokens are an update old, and the correction
    sees the newer tokens as (nearly) on-policy."""
    path = _config(tmp_path, "run", 2, rollout_rank=True, k=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["rollout"]["max_new_tokens"] = 6
    cfg["checkpoint"]["save_interval"] = 0
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=2, script=Path(__file__).with_name("partial_rollout_train.py"))
    batch2 = metrics(tmp_path / "run")[1]
    assert batch2["async/staleness"] == 1.0 and batch2["async/version"] == 1.0
    assert batch2["async/partial_frac"] > 0.5  # every response still writing after token 2
    assert 0 < batch2["async/staleness_tokens_1"] < 0.5 < batch2["async/staleness_tokens_0"]


@pytest.mark.parametrize("dying, says", [
    (1, ["stage 'rollout:batch:send[rollout->actor]'", "rank(s) [1] did not arrive within 20s"]),
    (0, ["the rendezvous store stopped answering", "rank 0"]),  # the trainer rank, which hosts the store
])
def test_a_rank_that_dies_stops_the_other_saying_so(tmp_path, capfd, monkeypatch, dying, says):
    from launch_support import _forked  # the ranks as forked children: no launcher kills the survivor

    from verl.checkpoint import verify

    path = _config(tmp_path, "run", 4, rollout_rank=True, k=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["devices"]["timeout_s"] = 20  # long enough for a loaded CI machine
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("DYING_RANK", str(dying))
    out = _forked(path, tmp_path, 2, Path(__file__).with_name("rollout_rank_dies_train.py"),
                  rank0_hosts=True, survivors_s=None)
    log = out.stdout + capfd.readouterr().err  # a forked rank's traceback goes to this process's stderr
    assert out.returncode != 0
    assert all(text in log for text in says), log[-3000:]
    assert verify(tmp_path / "run" / "checkpoints" / "step_1") == []  # the last checkpoint stays valid


def test_weights_travel_in_the_rollout_dtype_not_as_float32_masters(tmp_path):
    """float32 master weights computed in bfloat16 (fsdp.mixed_precision): a delivery moves parameters x 2
    bytes, cast at the source (it was parameters x 4: the master copy), and the rollout rank samples with
    what it received."""
    path = _config(tmp_path, "bf16", 2, rollout_rank=True, k=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["fsdp"] = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=2)
    rows = metrics(tmp_path / "bf16")
    parameters = 172_608  # the tiny model's (tied embeddings counted once)
    assert [r["async/weight_delivery_mb"] for r in rows] == [pytest.approx(parameters * 2 / 2**20)] * 2
    assert rows[1]["actor/grad_norm"] > 0 and rows[1]["async/staleness"] == 1.0


def test_a_rollout_longer_than_the_collective_timeout_is_waited_for(tmp_path, monkeypatch):
    """The rollout rank generates each batch after the first for longer than devices.timeout_s, while the
    trainer ranks wait to deliver their update: they wait outside any collective, so the run goes on (it ended
    with a collective timeout at the delivery)."""
    path = _config(tmp_path, "slow", 3, rollout_rank=True, k=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["devices"] = {**cfg["devices"], "timeout_s": 4}
    cfg["rollout"]["partial_rollout"] = False  # the whole batch on the old weights: the trainer waits for it
    cfg["checkpoint"]["save_interval"] = 0
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("SLOW_S", "9")
    verl_train(path, tmp_path, nproc=2, script=Path(__file__).with_name("slow_rollout_train.py"))
    rows = metrics(tmp_path / "slow")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["async/weight_delivery_s"] for r in rows) > 4  # waited past the timeout, then delivered
