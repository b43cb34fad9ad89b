"""On-policy distillation in the RL trainer (`algorithm.distill`): the teacher scores the student's tokens,
the reverse KL trains the student (as advantages or as a loss), a teacher with another tokenizer is refused
before anything loads, and LoRA students work."""

import pytest
import torch
from rl_support import rl_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl import RLTrainer
from verl.config import load_config, split_legacy_flags
from verl.errors import ConfigError, ModelError
from verl.trainer.build.models import resolve_model_path
from verl.trainer.checks.preflight import preflight


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sharpened_self(tmp_path, factor=3.0):
    """A teacher the student can reach: the student's own initial weights with every logit scaled by
    `factor` (tied embeddings: the scaled output layer scales the input embeddings too)."""
    src = resolve_model_path("tiny")
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    out = tmp_path / "teacher"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


def _exact_reverse_kl(trainer, batch):
    """KL(student || teacher) over the whole vocabulary at the first response token of `batch`'s prompts."""
    with torch.no_grad():
        inputs = {"input_ids": batch.prompt_ids, "attention_mask": batch.prompt_mask}
        s = torch.log_softmax(trainer.model(**inputs).logits[:, -1].double(), -1)
        t = torch.log_softmax(trainer.teacher(**inputs).logits[:, -1].double(), -1)
    return float((s.exp() * (s - t)).sum(-1).mean())


def test_a_teacher_equal_to_the_student_adds_nothing(tmp_path):
    """Same weights, same dtype: the reverse KL is exactly 0 on every token, so distillation alone gives
    zero advantages (and the update skips every sequence)."""
    trainer = RLTrainer(rl_config(tmp_path, "algorithm.distill.teacher_path=tiny",  # the trainer's old log-probs
                                  "algorithm.distill.task_reward=false", "trainer.total_steps=1",
                                  "actor.old_logprobs=recompute"))
    seen = {}
    real = trainer.compute_advantages

    def spy(batch):
        out = real(batch)
        seen["batch"] = out
        return out

    trainer.compute_advantages = spy
    metrics = trainer.step()
    batch = seen["batch"]
    assert torch.equal(batch.teacher_logprobs, batch.old_logprobs)
    assert metrics["distill/reverse_kl"] == 0.0 and "timing/teacher" in metrics
    assert torch.count_nonzero(batch.advantages) == 0


def test_reward_mode_pulls_the_student_towards_the_teacher(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path / "run", f"algorithm.distill.teacher_path={_sharpened_self(tmp_path)}",
                                  "algorithm.distill.task_reward=false", "trainer.total_steps=40", "actor.lr=3e-3"))
    probe = trainer.get_batch()
    before = _exact_reverse_kl(trainer, probe)
    for _ in range(40):
        trainer.step()
    after = _exact_reverse_kl(trainer, probe)
    assert after < 0.8 * before, (before, after)


def test_loss_mode_trains_on_the_kl_term_even_with_zero_advantages(tmp_path):
    """mode=loss without the task reward: every advantage is 0, yet the update runs every sequence (the
    zero-advantage skip would drop them) and its loss is coef x 0.5 (log pi_s - log pi_t)^2."""
    teacher = _sharpened_self(tmp_path)
    trainer = RLTrainer(rl_config(tmp_path / "run", f"algorithm.distill.teacher_path={teacher}",
                                  "algorithm.distill.mode=loss", "algorithm.distill.coef=2.0",
                                  "algorithm.distill.task_reward=false", "trainer.total_steps=1"))
    assert not trainer.skips_zero_advantage
    metrics = trainer.step()
    assert metrics["actor/pg_loss"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert metrics["actor/distill_loss"] > 0 and metrics["distill/reverse_kl"] != 0.0


def test_distillation_with_the_task_reward_keeps_the_task_advantages(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path, "algorithm.distill.teacher_path=tiny", "trainer.total_steps=1"))
    seen = {}
    real = trainer.compute_advantages
    trainer.compute_advantages = lambda batch: seen.setdefault("batch", real(batch))
    trainer.step()
    batch = seen["batch"]  # the teacher equals the student: what is left is the task's GRPO advantages
    assert torch.count_nonzero(batch.advantages) > 0


def test_a_lora_student_distils_from_a_full_teacher(tmp_path):
    trainer = RLTrainer(rl_config(tmp_path / "run", f"algorithm.distill.teacher_path={_sharpened_self(tmp_path)}",
                                  "model.lora.rank=4", "actor.kl_loss_coef=0.1", "trainer.total_steps=1"))
    metrics = trainer.step()  # the reference is the student with its adapters off; the teacher its own model
    assert metrics["distill/reverse_kl"] != 0.0 and metrics["actor/grad_norm"] > 0
    assert trainer.teacher is not trainer.ref_model


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_loads(tmp_path):
    other = resolve_model_path("tiny:llama")
    config = load_config(overrides=[f"trainer.run_dir={tmp_path}", f"algorithm.distill.teacher_path={other}"])
    problems = preflight(config, world_size=1, device_type="cpu", check_model=False).messages
    [problem] = [p for p in problems if "teacher_path" in p]
    assert problem.startswith(f"[model] algorithm.distill.teacher_path={other!r} has a different tokenizer from "
                              "model.path='tiny'")
    assert " vs " in problem and "only in algorithm.distill.teacher_path" in problem and "Fix:" in problem
    with pytest.raises(ModelError, match="teacher_path"):
        RLTrainer(config)


def test_discount_applies_to_reward_mode_only():
    with pytest.raises(ConfigError, match="discount=0.5 applies to mode=reward"):
        load_config(overrides=["algorithm.distill.mode=loss", "algorithm.distill.discount=0.5"])


def test_the_teacher_has_its_own_device_group():
    overrides, rest = split_legacy_flags(["algorithm.distill.teacher_path=tiny", "--teacher_device_ids", "1"])
    assert rest == []
    config = load_config(overrides=overrides)
    assert config.devices.teacher == [1]
    pf = preflight(config, world_size=2, device_type="cpu", check_model=False)
    assert pf.startup.mapping.ranks("teacher") == (1,) and pf.startup.mapping.ranks("actor") == (0, 1)


def test_verl_check_says_what_the_distillation_does():
    config = load_config(overrides=["algorithm.distill.teacher_path=tiny:qwen2:96:3", "algorithm.distill.mode=loss",
                                    "algorithm.distill.task_reward=false"])
    notes = preflight(config, world_size=1, device_type="cpu", check_model=False).startup.rl_notes
    assert ("distillation from tiny:qwen2:96:3: 1.0 x 0.5 (log pi_s - log pi_t)^2 added to the actor's loss, alone "
            "(algorithm.distill.task_reward=false)") in notes
