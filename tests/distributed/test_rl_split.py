"""The RL trainer with roles on different ranks: PPO on 4 gloo processes with the actor on [0, 1], the
critic on [2, 3], the reference on [0], a reward model on [3] and a distillation teacher of another size on
[2], then resumed with the same placement,
ending exactly where a straight run does.
The first run is a subclass that replaces one stage: the one `step()` runs it on the critic's ranks."""

import json
from pathlib import Path

import pytest
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

from verl.checkpoint import verify
from verl.models.tiny import build_tiny_reward_model

pytestmark = pytest.mark.dist


REWARD = """
def digit_share(prompt, response, ground_truth, **meta):
    return sum(c.isdigit() for c in response) / max(len(response), 1)
"""


def _config(tmp_path, steps):
    (tmp_path / "reward.py").write_text(REWARD)  # dense: the critic has something to learn at every step
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 3},
        "reward": {"functions": [{"name": f"{tmp_path / 'reward.py'}:digit_share"}],
                   "model_path": build_tiny_reward_model(), "model_weight": 0.5},
        "algorithm": {"adv_estimator": "gae", "kl_in_reward": True, "kl_coef": 0.5,
                      "distill": {"teacher_path": "tiny:qwen2:48:1", "coef": 0.5}},
        "actor": {"lr": 1e-3, "micro_batch_size": 2, "entropy_coef": 0.01, "kl_loss_coef": 0.1},
        "critic": {"lr": 1e-3, "micro_batch_size": 2},
        "devices": {"actor": [0, 1], "critic": [2, 3], "ref": [0], "reward": [3], "teacher": [2]},
        "trainer": {"total_steps": steps, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False, "cpu_threads": 1},
        "checkpoint": {"save_interval": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"cfg{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(tmp_path, steps, script=None):
    verl_train(_config(tmp_path, steps), tmp_path, nproc=4, script=script)
    return metrics(tmp_path / "run")


def test_split_placement_trains_checkpoints_and_resumes_exactly(tmp_path):
    rows = _train(tmp_path, 2, script=Path(__file__).with_name("custom_stage_train.py"))
    records = sorted(p.name for p in tmp_path.glob("values_rank*.json"))
    assert records == [f"values_rank{r}_step{s}.json" for r in (2, 3) for s in (0, 1)]  # the critic's ranks
    for path in tmp_path.glob("values_rank*.json"):  # each got its half of the 4 x 2 sequences, no policy
        assert json.loads(path.read_text()) == {"rows": 4, "holds_actor": False}
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 (actor + ref) logs once per step
    for r in rows:  # actor metrics from ranks 0-1, critic metrics from ranks 2-3 reach rank 0
        assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0
        assert {"actor/kl_loss", "actor/ref_kl", "kl/in_reward", "critic/vf_loss", "critic/grad_norm"} <= set(r)
        assert "reward/reward_model/score" in r and "timing/reward_model" in r  # scored on rank 3
        assert r["distill/reverse_kl"] != 0.0 and "timing/teacher" in r  # the teacher's log-probs from rank 2
    # the ref anchors the actor: at step 1 the KL is the sampler's rounding (its log-probs are the old policy's)
    assert abs(rows[0]["kl/in_reward"]) < 1e-6 < abs(rows[1]["kl/in_reward"])
    assert "val/score" in rows[-1]
    step2 = tmp_path / "run" / "checkpoints" / "step_2"
    assert verify(step2) == []
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    assert {"model", "optimizer", "critic", "critic_optimizer"} <= set(manifest["app_state_keys"])

    rows = _train(tmp_path, 3)  # same placement: each rank loads back what it holds
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["critic/grad_norm"] > 0
    assert verify(tmp_path / "run" / "checkpoints" / "step_3") == []

    # ... and exactly: the resumed run ends where one straight 3-step run does (the recording subclass of the
    # first two steps changes no numbers)
    straight = tmp_path / "straight"
    straight.mkdir()
    want = _train(straight, 3)[-1]
    keys = [k for k in want if not k.startswith(("timing/", "perf/"))]
    assert {k: rows[-1][k] for k in keys} == {k: want[k] for k in keys}
