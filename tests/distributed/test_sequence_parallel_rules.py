"""Sequence parallelism without processes: what is refused (and said) at start-up and by `verl check`, the
model hook leaving every other forward alone, and the batch arithmetic of the sequence-parallel groups."""

from __future__ import annotations

import pytest
import torch

from verl.batch import RolloutBatch
from verl.config import load_config
from verl.distributed.sequence_parallel import (
    enable_sequence_parallel,
    kv_heads_sent,
    sequence_parallel_layout,
    sequence_parallel_problems,
)
from verl.errors import ConfigError
from verl.trainer.checks.preflight import preflight
from verl.trainer.forward.batch_math import plan_batches
from verl.trainer.forward.sequence_parallel import group_plan
from verl.trainer.rl.update import micro_weights


def _tiny(heads: int = 4, kv: int = 2, **extra):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=8 * heads, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False, **extra)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float()


def test_problems_name_the_key_the_numbers_and_the_fix():
    assert sequence_parallel_problems(1, actor_ranks=3, num_heads=5) == []
    [ranks] = sequence_parallel_problems(4, actor_ranks=6)
    assert ranks == ("actor.sequence_parallel_size=4 does not divide the actor's 6 rank(s): each sequence-parallel "
                     "group is 4 actor ranks. Fix: launch a multiple of 4 actor ranks, or use a divisor of 6")
    [heads] = sequence_parallel_problems(3, num_heads=4, num_kv_heads=2)
    assert heads == ("actor.sequence_parallel_size=3 does not divide the model's 4 attention heads: each rank "
                     "attends with whole heads. Fix: use one of [1, 2, 4]")
    [arch] = sequence_parallel_problems(2, model_type="gemma2")
    assert ("not model_type='gemma2'" in arch and "qwen2, llama" in arch
            and "Fix: set actor.sequence_parallel_size=1" in arch)
    [window] = sequence_parallel_problems(2, sliding_window=True)
    assert "sliding-window attention" in window and "use_sliding_window: false" in window
    # key/value heads need not divide: they are repeated up to lcm(KV, S)
    assert sequence_parallel_problems(4, num_heads=8, num_kv_heads=2) == []
    assert [kv_heads_sent(2, 4), kv_heads_sent(1, 2), kv_heads_sent(4, 2), kv_heads_sent(3, 2)] == [4, 2, 4, 6]


def test_groups_are_consecutive_actor_ranks():
    assert sequence_parallel_layout((0, 1, 2, 3), 2) == [(0, 1), (2, 3)]
    assert sequence_parallel_layout((2, 3, 4, 5, 6, 7), 3) == [(2, 3, 4), (5, 6, 7)]
    with pytest.raises(ConfigError, match="does not divide the actor's 3 rank"):
        sequence_parallel_layout((0, 1, 2), 2)


def _check(*overrides, world=2):
    config = load_config(overrides=["env.name=arithmetic", "trainer.device=cpu", *overrides])
    return preflight(config, world_size=world, device_type="cpu", check_model=False)


def test_verl_check_refuses_what_cannot_split_and_says_what_can():
    # the tiny model has 4 attention heads and 2 key/value heads
    assert _check("actor.sequence_parallel_size=3", "data.train_batch_size=6", world=6).messages == [
        "[start-up] actor.sequence_parallel_size=3 does not divide the model's 4 attention heads: each rank attends "
        "with whole heads. Fix: use one of [1, 2, 4]"]
    [ranks] = _check("actor.sequence_parallel_size=2", world=1).messages
    assert "does not divide the actor's 1 rank(s)" in ranks
    [placed] = _check("actor.sequence_parallel_size=2", "devices.actor=[0,1,2]", "data.train_batch_size=6",
                      world=4).messages
    assert "does not divide the actor's 3 rank(s)" in placed
    ok = _check("actor.sequence_parallel_size=4", world=8)
    assert ok.messages == []
    [note] = [n for n in ok.startup.rl_notes if n.startswith("sequence parallelism")]
    assert "2 group(s) of 4 consecutive actor ranks" in note
    assert "1 query head(s) per rank, the 2 key/value head(s) repeated to 4 so that each rank gets its 1" in note


def _offline(kind, *overrides, world=2):
    """The start-up report and its sequence-parallel messages (no data files are given: that is reported too)."""
    config = load_config(overrides=["trainer.device=cpu", f"trainer.kind={kind}", "sft.batch_size=4", *overrides])
    report = preflight(config, world_size=world, device_type="cpu", kind=kind, check_model=False)
    return report, [m for m in report.messages if "sequence_parallel" in m]


def test_sft_and_dpo_split_sequences_the_reward_model_is_refused(tmp_path):
    for kind in ("sft", "dpo"):
        ok, messages = _offline(kind, "actor.sequence_parallel_size=2", world=4)
        assert messages == []
        [note] = [n for n in ok.startup.rl_notes if n.startswith("sequence parallelism")]
        assert "the ranks of a group read the same rows (data parallelism over the 2 group(s))" in note
        _, [ranks] = _offline(kind, "actor.sequence_parallel_size=3", world=3)
        assert "does not divide the model's 4 attention heads" in ranks
    odd = tmp_path / "odd"  # a reference of its own that cannot split: refused before loading, as in RL
    _tiny(heads=3, kv=1).save_pretrained(odd)
    _, [ref] = _offline("dpo", "actor.sequence_parallel_size=2", f"ref.path={odd}")
    assert ref.startswith("[start-up] ref.path (the reference, on the actor's ranks, splits its sequences with the "
                          "actor's groups): actor.sequence_parallel_size=2 does not divide the model's 3 attention")
    _, [rm] = _offline("rm", "actor.sequence_parallel_size=2")
    assert rm == ("[start-up] actor.sequence_parallel_size=2 with trainer.kind=rm: the reward-model trainer scores "
                  "whole sequences and does not split them. Fix: set actor.sequence_parallel_size=1")
    assert _offline("sft", "actor.sequence_parallel_size=2", "sft.packing=true")[1] == []  # packed rows split too


def test_the_model_hook_refuses_what_cannot_split():
    with pytest.raises(ConfigError) as info:
        enable_sequence_parallel(_tiny(heads=3, kv=1), 2)
    assert "does not divide the model's 3 attention heads" in str(info.value)
    with pytest.raises(ConfigError) as info:
        enable_sequence_parallel(_tiny(use_sliding_window=True, sliding_window=4, max_window_layers=0), 2)
    assert "sliding-window attention" in str(info.value)
    with pytest.raises(ConfigError) as info:
        enable_sequence_parallel(torch.nn.Linear(2, 2), 2)
    assert "Linear has no attention modules with q_proj/k_proj/v_proj to split" in str(info.value)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_hook_leaves_other_forwards_and_the_model_config_alone(attn):
    model, before = _tiny(), _tiny()
    for m in (model, before):
        m.config._attn_implementation = attn
    ids = torch.randint(1, 64, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    assert enable_sequence_parallel(model, 2) == 2
    assert enable_sequence_parallel(model, 2) == 2  # idempotent
    assert model.config._attn_implementation == attn  # masks and the rollout engine see the original
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           before(input_ids=ids, attention_mask=mask).logits)
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert torch.equal(generated, before.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))


class _Ranks:
    """A placement whose all-reduce sums over `ranks` ranks holding the same rows."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    def all_reduce_sum(self, values, role="actor"):
        return values * self.ranks

    def role_size(self, role="actor"):
        return self.ranks


def test_replicas_count_each_row_once_and_sum_their_gradients():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    batch = RolloutBatch(rows=[{}] * 3, group_ids=torch.arange(3), prompt_ids=torch.ones(3, 1, dtype=torch.long),
                         prompt_mask=torch.ones(3, 1, dtype=torch.long), response_ids=mask, response_mask=mask)
    groups = [torch.tensor([0]), torch.tensor([1, 2])]
    one = micro_weights(batch, groups, "token-mean", _Ranks(1))
    assert one == [0.5, 0.5]
    # 2 ranks of one sequence-parallel group: the rows are counted once, and the weight is doubled so that FSDP's
    # average over the 2 ranks is the sum of their gradients (each through its own half of the tokens)
    assert micro_weights(batch, groups, "token-mean", _Ranks(2), replicas=2) == [1.0, 1.0]
    # 4 ranks in 2 groups of 2, the other group holding the same number of tokens
    assert micro_weights(batch, groups, "seq-mean-token-mean", _Ranks(4), replicas=2) == pytest.approx(
        [4 / 6, 8 / 6])


def test_a_group_plans_the_pooled_rows_of_its_ranks():
    cfg = load_config(overrides=["actor.micro_batch_size=4", "actor.mini_batch_size=4"]).actor
    plan = plan_batches(8, 2, cfg, 4)
    assert (plan.mini_batch_sequences, plan.micro_batch_size, plan.num_mini_batches) == (2, 2, 2)
    pooled = group_plan(plan, cfg, 2)
    assert (pooled.dp_size, pooled.mini_batch_sequences, pooled.micro_batch_size, pooled.grad_accum_steps,
            pooled.num_mini_batches) == (2, 4, 4, 1, 2)
    assert group_plan(plan, cfg, 1) is plan


def test_the_policy_and_a_sequence_parallel_reference_split_a_teacher_does_not():
    from types import SimpleNamespace

    from verl.models.lora import AdapterOff
    from verl.trainer.forward.sequence_parallel import ActorSequenceParallel, splits_sequences

    policy, reference, teacher = _tiny(), _tiny(), _tiny()
    enable_sequence_parallel(reference, 2)  # what start-up does for a reference on the actor's ranks
    group = ActorSequenceParallel(SimpleNamespace(size=2), None, 0, torch.device("cpu"))
    assert group.splits(policy, policy) and group.splits(reference, policy) and not group.splits(teacher, policy)
    assert splits_sequences(reference) and not splits_sequences(policy)

    class Peft(torch.nn.Module):  # the reference of a LoRA policy is the policy with its adapters off
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

    enable_sequence_parallel(policy, 2)
    assert group.splits(AdapterOff(Peft(policy)), Peft(policy))
    single = ActorSequenceParallel(None, None, 0, torch.device("cpu"))
    assert not single.splits(reference, policy)  # no group: nothing splits


class _Groups:
    def __init__(self, **ranks):
        self.by_role = ranks

    def ranks(self, role):
        return self.by_role[role]


@pytest.mark.parametrize("critic_ranks,splits", [((0, 1), True), ((2, 3), False)])
def test_a_critic_on_the_actors_ranks_splits_its_sequences_one_on_its_own_runs_whole_ones(critic_ranks, splits):
    from types import SimpleNamespace

    from verl.trainer.compose.components import setup_critic
    from verl.trainer.forward.sequence_parallel import splits_sequences

    config = load_config(overrides=["env.name=arithmetic", "trainer.device=cpu", "algorithm.adv_estimator=gae",
                                    "actor.sequence_parallel_size=2"])
    process = SimpleNamespace(groups=_Groups(actor=(0, 1), critic=critic_ranks), device=torch.device("cpu"),
                              dtype=torch.float32)
    policy = _tiny()
    critic = setup_critic(config, policy, process, "tiny")
    assert splits_sequences(critic) is splits
    assert not splits_sequences(policy)  # the copy's attention is its own: the policy is made to split later


@pytest.mark.parametrize("teacher_ranks,splits", [((0, 1), True), ((2,), False)])
def test_a_teacher_on_the_actors_ranks_splits_its_sequences(teacher_ranks, splits, monkeypatch):
    from types import SimpleNamespace

    from verl.trainer.build.models import resolve_model_path
    from verl.trainer.compose import components
    from verl.trainer.compose.components import setup_teacher
    from verl.trainer.forward.sequence_parallel import splits_sequences
    from verl.utils.hf_loader import load_tokenizer

    config = load_config(overrides=["env.name=arithmetic", "trainer.device=cpu", "algorithm.distill.teacher_path=tiny",
                                    "actor.sequence_parallel_size=2"])
    process = SimpleNamespace(groups=_Groups(actor=(0, 1), teacher=teacher_ranks), device=torch.device("cpu"),
                              dtype=torch.float32, frozen_dtype=None, world_size=1, split=False)  # loads whole
    monkeypatch.setattr(components, "shard_frozen", lambda module, *_: module)  # no process group here
    assert splits_sequences(setup_teacher(config, load_tokenizer(resolve_model_path("tiny")), process)) is splits


def test_verl_check_says_which_models_split_with_the_actor_and_checks_their_own(tmp_path):
    ok = _check("actor.sequence_parallel_size=2", "algorithm.adv_estimator=gae", "actor.kl_loss_coef=0.1")
    [note] = [n for n in ok.startup.rl_notes if n.startswith("sequence parallelism")]
    assert note.endswith("; the reference and critic, on the actor's ranks, split sequences the same way")
    apart = _check("actor.sequence_parallel_size=2", "algorithm.adv_estimator=gae", "devices.actor=[0,1]",
                   "devices.critic=[2]", world=3)
    [note] = [n for n in apart.startup.rl_notes if n.startswith("sequence parallelism")]
    assert "critic" not in note
    odd = tmp_path / "odd"
    _tiny(heads=3, kv=1).save_pretrained(odd)
    [critic] = _check("actor.sequence_parallel_size=2", "algorithm.adv_estimator=gae", f"critic.path={odd}").messages
    assert critic.startswith("[start-up] critic.path (the critic, on the actor's ranks, splits its sequences with "
                             "the actor's groups): actor.sequence_parallel_size=2 does not divide the model's 3 "
                             "attention heads")
    teacher = _check("actor.sequence_parallel_size=2", f"algorithm.distill.teacher_path={odd}").messages
    assert any(m.startswith("[start-up] algorithm.distill.teacher_path (the teacher, on the actor's ranks") and
               "does not divide the model's 3 attention heads" in m for m in teacher), teacher


def test_an_offline_batch_that_the_replicas_cannot_share_is_refused_by_replica():
    from types import SimpleNamespace

    from verl.trainer.offline.base import OfflineTrainer

    trainer = object.__new__(OfflineTrainer)  # the attributes build_sampler reads: 4 ranks in 2 groups of 2
    trainer.config, trainer.dp_size, trainer.sp = (load_config(overrides=["trainer.device=cpu"]), 2,
                                                   SimpleNamespace(size=2))
    with pytest.raises(ConfigError, match=r"sft.batch_size=3 is not divisible by the 2 data-parallel replicas "
                                          r"\(sequence-parallel groups of 2 ranks\); use a multiple of 2"):
        trainer.build_sampler(10, 3, "sft.batch_size")
    assert trainer.build_sampler(10, 4, "sft.batch_size").num_rows == 10
