"""The update does less work for the same gradient: zero-advantage sequences are skipped and micro-batches
can be packed by a token budget. Every gradient is checked in float64 against one big-batch computation
written here independently (one forward of the whole mini-batch at full width, one loss, one backward)."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from rl_support import batch_of_lengths, captured_update, random_groups, rl_config

from verl.algorithms import aggregate_loss, place_score_on_last_token, ppo_policy_loss
from verl.errors import RolloutError
from verl.trainer.forward.logprobs import response_logprobs
from verl.trainer.rl import update
from verl.trainer.rl_trainer import RLTrainer

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _trainer(tmp_path, *overrides, share: bool = False) -> RLTrainer:
    trainer = RLTrainer(rl_config(tmp_path, "trainer.total_steps=1", "rollout.max_new_tokens=10",
                                  "actor.shuffle=false", f"actor.share_prompt_forward={share}", *overrides))
    trainer.model.double()
    return trainer


def _batch(trainer: RLTrainer, equal_groups: tuple[int, ...]):
    """A rollout batch whose groups `equal_groups` have equal rewards (zero GRPO advantage), others differ."""
    batch = trainer.get_batch()
    batch = trainer.compute_reward(trainer.generate(batch))
    scores = torch.arange(len(batch), dtype=torch.float32) % 4 / 3.0  # no member equals its group mean
    for g in equal_groups:
        scores[batch.group_ids == g] = 0.5
    batch.scores = scores
    batch.token_rewards = place_score_on_last_token(scores, batch.response_mask.float())
    batch = trainer.compute_advantages(trainer.compute_log_probs(batch))
    return batch


def _reference_grads(trainer: RLTrainer, batch) -> dict[str, torch.Tensor]:
    """One forward of the whole batch, one loss, one backward (float64)."""
    cfg = trainer.config.actor
    model = trainer.model
    model.zero_grad(set_to_none=True)
    width = batch.response_ids.shape[1]
    logprobs, entropy = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.position_ids, width,
                                          with_entropy=True)
    mask = batch.response_mask.double()
    old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    loss, _ = ppo_policy_loss(logprobs, old, batch.advantages.double(), mask, clip_low=cfg.loss_kwargs()["clip_low"],
                              clip_high=cfg.loss_kwargs()["clip_high"], agg=cfg.loss_agg, norm_len=width)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * aggregate_loss(entropy, mask, cfg.loss_agg, norm_len=width)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _update_grads(trainer: RLTrainer, batch) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """The trainer's update_policy, capturing the accumulated gradient instead of stepping; and the number
    of model forwards it ran."""
    return captured_update(trainer, trainer.model, trainer.update_policy, batch)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-9) -> None:
    """Equal up to `tol` x the tensor's largest entry. Note: Hugging Face's RMSNorm computes in float32 even
    in a float64 model, so paths that sum the same terms in another order agree to ~1e-7, not 1e-15."""
    assert set(got) == set(want)
    for name, g in want.items():
        assert g.dtype == torch.float64
        assert float((got[name] - g).abs().max()) <= tol * max(float(g.abs().max()), 1e-30), name
    assert any(g.abs().max() > 0 for g in want.values())


@pytest.mark.parametrize("agg", AGGS)
def test_skipping_zero_advantage_groups_keeps_the_gradient(tmp_path, agg):
    trainer = _trainer(tmp_path, f"actor.loss_agg={agg}", "actor.micro_batch_size=3")
    batch = _batch(trainer, equal_groups=(0, 2))
    want = _reference_grads(trainer, batch)
    got, metrics, forwards = _update_grads(trainer, batch)
    _assert_same(got, want)
    assert metrics["actor/skipped_frac"] == 0.5
    assert forwards == 3  # the 8 sequences of groups 1 and 3 in micro-batches of 3 (16 unskipped would be 6)


def test_every_group_equal_runs_one_zero_weight_micro_batch_and_still_steps(tmp_path):
    trainer = _trainer(tmp_path, "actor.micro_batch_size=4")
    batch = _batch(trainer, equal_groups=(0, 1, 2, 3))
    got, metrics, forwards = _update_grads(trainer, batch)
    assert metrics["actor/skipped_frac"] == 1.0 and forwards == 1
    assert metrics["actor/pg_loss"] == 0.0 and "actor/entropy" in metrics  # the documented keys are still logged
    assert got and all(bool((g == 0).all()) for g in got.values())  # zero gradients, as the full update gives


@pytest.mark.parametrize("override", ["actor.entropy_coef=0.01", "actor.skip_zero_advantage=false",
                                      "actor.target_entropy=1.0"])
def test_no_skipping_with_an_entropy_bonus_or_when_turned_off(tmp_path, override):
    trainer = _trainer(tmp_path, "actor.micro_batch_size=4", override)
    batch = _batch(trainer, equal_groups=(0, 2))
    want = _reference_grads(trainer, batch)
    got, metrics, forwards = _update_grads(trainer, batch)
    _assert_same(got, want)
    assert "actor/skipped_frac" not in metrics and forwards == 4


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("budget", [40, 90, 10_000])
def test_token_budget_micro_batches_keep_the_gradient(tmp_path, agg, budget):
    trainer = _trainer(tmp_path, f"actor.loss_agg={agg}", f"actor.max_tokens_per_micro_batch={budget}",
                       "actor.entropy_coef=0.01")  # nothing skipped: every sequence runs
    batch = _batch(trainer, equal_groups=())
    want = _reference_grads(trainer, batch)
    got, _, forwards = _update_grads(trainer, batch)
    _assert_same(got, want)
    groups = update.micro_batch_groups(batch, 8, budget)
    assert forwards == len(groups)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(batch)))
    for g in groups:  # each micro-batch fits the budget unless it is a single over-long row
        mb = update.micro_batch(batch, g, trim=True)
        assert len(g) == 1 or mb.input_ids.numel() <= budget


def test_token_budget_groups_by_length_and_trims_padding():
    lengths = [2, 9, 3, 8, 1, 7]
    mask = (torch.arange(10)[None, :] < torch.tensor(lengths)[:, None]).long()
    batch = batch_of_lengths(lengths)
    groups = update.micro_batch_groups(batch, 8, 24)
    assert [g.tolist() for g in groups] == [[1, 3], [5, 2], [0, 4]]  # (2+9)*2=22, (2+7)*2=18, (2+2)*2=8
    mb = update.micro_batch(batch, groups[1], trim=True)
    assert mb.prompt_ids.shape == (2, 2) and mb.response_mask.shape == (2, 7) and mb.advantages.shape == (2, 7)
    assert torch.equal(mb.response_mask, mask[[5, 2], :7])


def test_no_grad_passes_with_a_token_budget_match_the_plain_pass(tmp_path):
    trainer = _trainer(tmp_path, "actor.max_tokens_per_micro_batch=30")
    batch = _batch(trainer, equal_groups=())
    budgeted = trainer.sequence_logprobs(trainer.model, batch)
    trainer.config.actor.max_tokens_per_micro_batch = None
    plain = trainer.sequence_logprobs(trainer.model, batch)
    mask = batch.response_mask.bool()
    assert budgeted.shape == plain.shape and budgeted.dtype == torch.float64
    assert torch.allclose(budgeted[mask], plain[mask], rtol=0, atol=1e-10)
    assert bool((budgeted[~mask] == 0).all())


def test_no_grad_passes_run_micro_batches_of_the_update_size(tmp_path):
    """Old and reference log-probs come from forwards of the update's row count: a float32 matmul's sums can
    depend on its row count (MKL on some CPUs), and only equal sizes keep PPO's first ratio at exactly 1."""
    trainer = _trainer(tmp_path, "actor.micro_batch_size=4")
    batch = trainer.get_batch()
    sizes = []
    trainer.forward_in_micro_batches(trainer.model, batch, lambda mb: sizes.append(len(mb)) or torch.zeros(len(mb), 1))
    assert len(batch) == 16 and sizes == [4, 4, 4, 4]


def test_entropy_for_logging_builds_no_autograd_graph(tmp_path):
    trainer = _trainer(tmp_path)
    batch = _batch(trainer, equal_groups=())
    width = batch.response_ids.shape[1]
    args = (trainer.model, batch.input_ids, batch.attention_mask, batch.position_ids, width)
    logprobs, entropy = response_logprobs(*args, with_entropy=True, entropy_grad=False)
    assert logprobs.grad_fn is not None and entropy.grad_fn is None and not entropy.requires_grad
    _, with_grad = response_logprobs(*args, with_entropy=True, entropy_grad=True)
    assert with_grad.grad_fn is not None
    assert torch.allclose(entropy, with_grad.detach(), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- shared-prompt forward
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_shared_prompt_forward_gives_the_unshared_logprobs_and_gradients(dtype, tol):
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model
    from verl.trainer.forward.logprobs import can_share_prompt, shared_prompt_logprobs
    from verl.utils.positions import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=dtype)
    assert can_share_prompt(model)
    prompt_ids, prompt_mask, response_ids, response_mask, weights = random_groups()
    forwards = []
    model.register_forward_hook(lambda module, args, kwargs, out: forwards.append(kwargs["input_ids"].shape),
                                with_kwargs=True)

    def run(fn):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = fn()
        ((logprobs * weights.to(dtype)).sum() + (entropy * response_mask).sum()).backward()
        return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ids, mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    want_lp, want = run(lambda: response_logprobs(model, ids, mask, position_ids_from_mask(mask), 6,
                                                  temperature=0.7, with_entropy=True))
    forwards.clear()
    got_lp, got = run(lambda: shared_prompt_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                                                     temperature=0.7, with_entropy=True))
    # 3 distinct prompts once (all but their last token), then the 12 responses on their keys/values: the
    # prompt's last token and the responses but their last token (which predicts nothing)
    assert forwards == [(3, 6), (12, 6)]
    real = response_mask.bool()
    assert float((got_lp - want_lp)[real].abs().max()) <= tol * float(want_lp[real].abs().max())
    want = {k: v.double() for k, v in want.items()}
    _assert_same({k: v.double() for k, v in got.items()}, want, tol)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("extra", [("actor.micro_batch_size=3",), ("actor.max_tokens_per_micro_batch=60",),
                                   ("actor.micro_batch_size=8", "actor.entropy_coef=0.01")])
def test_the_update_with_shared_prompts_keeps_the_gradient(tmp_path, agg, extra):
    trainer = _trainer(tmp_path, f"actor.loss_agg={agg}", *extra, share=True)
    assert trainer.shares_prompt(trainer.model)
    batch = _batch(trainer, equal_groups=(2,))
    want = _reference_grads(trainer, batch)
    got, _, forwards = _update_grads(trainer, batch)
    _assert_same(got, want, 1e-6)
    assert forwards % 2 == 0  # each micro-batch: one prompt forward, one response forward


def test_shared_old_logprobs_equal_the_unshared_pass(tmp_path):
    trainer = _trainer(tmp_path, "actor.micro_batch_size=3", share=True)
    batch = _batch(trainer, equal_groups=())
    shared = trainer.sequence_logprobs(trainer.model, batch)
    trainer.config.actor.share_prompt_forward = False
    plain = trainer.sequence_logprobs(trainer.model, batch)
    mask = batch.response_mask.bool()
    assert torch.allclose(shared[mask], plain[mask], rtol=0, atol=1e-10)


def test_groups_are_shuffled_whole_when_prompts_are_shared(tmp_path):
    trainer = _trainer(tmp_path, share=True)
    batch = _batch(trainer, equal_groups=())
    order = update.update_order(batch, shuffle=True, keep_groups=True, generator=trainer.shuffle_generator)
    assert sorted(order.tolist()) == list(range(len(batch)))
    ids = batch.group_ids[order].tolist()
    assert all(ids[i] == ids[i - i % 4] for i in range(len(ids)))  # contiguous groups
    assert ids != sorted(ids) or len(set(ids)) == 1


def test_unsharded_shared_prompt_backward_skips_the_prompt_logits():
    """The zero-weighted term that keeps the prompt forward's logits on the backward path is for FSDP2 only;
    in one process the backward reaches the prompt forward through its keys/values alone."""
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model
    from verl.trainer.forward.logprobs import shared_prompt_logprobs

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=torch.float32)
    prompt_ids, prompt_mask, response_ids, response_mask, weights = random_groups()
    head_grads = []
    model.lm_head.register_forward_hook(lambda module, args, out: [out.register_hook(head_grads.append), None][1])
    logprobs, _ = shared_prompt_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)
    (logprobs * weights.float()).sum().backward()
    assert len(head_grads) == 1  # the responses' head only
    assert all(p.grad is not None for p in model.parameters())  # the prompt forward's layers still learn


@pytest.mark.parametrize("shared", [False, True])
def test_only_positions_whose_logit_is_used_run(shared):
    """The last token predicts past the response: neither the layers nor the head run on it, and the head
    runs only on positions that predict a response token. The logits are those of the full forward, cut."""
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model
    from verl.trainer.forward.logprobs import sequence_logits, shared_prompt_logits
    from verl.utils.positions import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=torch.float32)
    prompt_ids, prompt_mask, response_ids, response_mask, _ = random_groups()
    head_rows, layer_rows = [], []
    model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[1]))
    model.model.layers[0].register_forward_hook(lambda module, args, out: layer_rows.append(args[0].shape[1]))
    ids, mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    positions = position_ids_from_mask(mask)
    width = response_ids.shape[1]
    if shared:
        got = shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_mask)
        assert head_rows == [1, width]  # the prompt forward's last position; the responses' own
        assert sum(layer_rows) == ids.shape[1] - 1  # all but the prompt's last token; it and all but the last
    else:
        got = sequence_logits(model, ids, mask, positions, width)
        assert head_rows == [width] and layer_rows == [ids.shape[1] - 1]
    full = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    assert got.shape == (len(ids), width, full.shape[-1])
    if not shared:  # the same rows' forward, one column shorter: equal up to float32 rounding
        torch.testing.assert_close(got, full[:, -width - 1 : -1], rtol=1e-5, atol=1e-5)


def test_truncated_importance_sampling_weighs_each_token_by_the_samplers_probability(tmp_path):
    """actor.tis_cap (deprecated alias of rollout_correction mode token_tis): each token's loss x min(pi_old /
    pi_rollout, cap). With the sampler's log-probs equal to
    the trainer's, every weight is the cap 0.5 (ratio 1 > 0.5); a response the sampler found e^10 times
    likelier than the trainer weighs e^-10. In the clip-free on-policy update, that is the plain update with
    those sequences' advantages scaled by their weights."""
    trainer = _trainer(tmp_path, "actor.tis_cap=0.5", "rollout.max_logprob_drift=null")
    batch = _batch(trainer, equal_groups=())
    with torch.no_grad():
        width = batch.response_ids.shape[1]
        trainer_logprobs, _ = response_logprobs(trainer.model, batch.input_ids, batch.attention_mask,
                                                batch.position_ids, width)
    batch.rollout_logprobs = trainer_logprobs.clone()
    batch.rollout_logprobs[0] += 10.0
    got, metrics, _ = _update_grads(trainer, batch)
    scaled = copy.copy(batch)
    factor = torch.full((len(batch), 1), 0.5, dtype=torch.float64)
    factor[0] = math.exp(-10.0)
    scaled.advantages = batch.advantages.double() * factor
    want = _reference_grads(trainer, scaled)
    _assert_same(got, want, 1e-6)
    mask = batch.response_mask.float()
    assert metrics["rollout_corr/truncated_frac"] == pytest.approx(float(mask[1:].sum() / mask.sum()))

    batch.rollout_logprobs = None
    with pytest.raises(RolloutError,
                       match="actor.rollout_correction.mode=token_tis weighs each token by the sampler's"):
        trainer.update_policy(batch)


def test_high_entropy_fraction_trains_only_the_top_tokens_of_the_micro_batch(tmp_path):
    """actor.entropy_top_fraction=0.2 (arXiv 2506.01939): the update's gradient is the plain update's with the
    advantages of all but the highest-entropy 20% of the micro-batch's tokens set to 0 (the loss normaliser
    keeps every token); the entropy quantile metrics are those of the batch's tokens."""
    trainer = _trainer(tmp_path, "actor.entropy_top_fraction=0.2", "actor.micro_batch_size=64")
    batch = _batch(trainer, equal_groups=())
    with torch.no_grad():
        _, entropy = response_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                       batch.response_ids.shape[1], with_entropy=True)
    mask = batch.response_mask.double()
    flat = entropy[mask.bool()]
    threshold = flat.sort(descending=True).values[math.ceil(0.2 * flat.numel()) - 1]
    top = ((entropy >= threshold) & mask.bool()).double()
    scaled = copy.copy(batch)
    scaled.advantages = batch.advantages.double() * top
    want = _reference_grads(trainer, scaled)
    got, metrics, _ = _update_grads(trainer, batch)
    _assert_same(got, want, 1e-6)
    full = _reference_grads(trainer, batch)
    assert any(float((full[k] - want[k]).abs().max()) > 1e-3 * float(full[k].abs().max()) for k in full)
    assert metrics["actor/entropy_top_frac"] == pytest.approx(float(top.sum() / mask.sum()))
    quantiles = torch.quantile(flat, torch.tensor([0.1, 0.5, 0.9], dtype=flat.dtype)).tolist()
    assert [metrics[f"actor/entropy_q{q}"] for q in (10, 50, 90)] == pytest.approx(quantiles, rel=1e-9)


def test_dr_grpos_normaliser_is_the_generation_budget_not_the_batch_width(tmp_path):
    """seq-mean-token-sum-norm divides by a constant: rollout.max_new_tokens, however long this batch's longest
    response is. A budget twice the batch's width halves the gradient of the width-normalised loss."""
    trainer = _trainer(tmp_path, "actor.loss_agg=seq-mean-token-sum-norm", "algorithm.norm_by_std=false")
    batch = _batch(trainer, equal_groups=())
    width = batch.response_ids.shape[1]
    want = {k: 0.5 * v for k, v in _reference_grads(trainer, batch).items()}  # normalised by the width
    trainer.config.rollout.max_new_tokens = 2 * width
    got, _, _ = _update_grads(trainer, batch)
    _assert_same(got, want, 1e-6)


def test_masking_truncated_responses_leaves_them_out_of_the_loss(tmp_path):
    """actor.mask_truncated (DAPO's overlong filtering): the update's gradient is the loss over the finished
    responses only, normalised over their tokens; the cut-off ones are still read by attention."""
    trainer = _trainer(tmp_path, "actor.mask_truncated=true")
    batch = _batch(trainer, equal_groups=())
    batch.finished = torch.arange(len(batch)) % 3 != 0  # every third response was cut off
    got, _, _ = _update_grads(trainer, batch)
    finished_only = copy.copy(batch)
    finished_only.response_mask = batch.response_mask * batch.finished[:, None].to(batch.response_mask.dtype)
    finished_only.response_attention_mask = batch.response_attention
    _assert_same(got, _reference_grads(trainer, finished_only), 1e-6)
    plain, _, _ = _update_grads(_trainer(tmp_path / "plain"), batch)
    assert any(float((plain[k] - got[k]).abs().max()) > 1e-6 for k in got)  # it did leave them out


# ---------------------------------------------------------------- the critic's normaliser, budgets, metrics
@pytest.mark.parametrize("split", [("critic.micro_batch_size=16",),
                                   ("critic.micro_batch_size=3", "critic.max_tokens_per_micro_batch=40")])
def test_critic_seq_mean_token_sum_norm_gradient_does_not_depend_on_the_micro_batches(tmp_path, split):
    """The critic's seq-mean-token-sum-norm divides every sequence by one constant for the whole batch (as the
    actor's: max(batch width, rollout.max_new_tokens)), not by each (trimmed) micro-batch's own width: one
    micro-batch and several budget-packed ones give the one-big-batch gradient (loss in float64)."""
    from verl.algorithms import value_loss
    from verl.trainer.forward.logprobs import response_values

    trainer = _trainer(tmp_path, "algorithm.adv_estimator=gae", "critic.loss_agg=seq-mean-token-sum-norm",
                       "critic.shuffle=false", "critic.share_prompt_forward=false", *split)
    batch = trainer.generate(trainer.get_batch())
    lengths = 3 + torch.arange(len(batch)) % 7  # responses that stopped early: the micro-batches' trims differ
    batch.response_mask = (torch.arange(batch.response_ids.shape[1])[None] < lengths[:, None]).long()
    batch.response_ids = batch.response_ids * batch.response_mask
    batch = trainer.compute_reward(batch)
    batch = trainer.compute_advantages(trainer.compute_values(trainer.compute_log_probs(batch)))
    width = batch.response_ids.shape[1]
    trainer.config.rollout.max_new_tokens = 16  # the generation budget, wider than this batch
    critic = trainer.critic
    critic.zero_grad(set_to_none=True)
    values = response_values(critic, batch.input_ids, batch.attention_mask, batch.position_ids, width).double()
    loss, _ = value_loss(values, batch.values.double(), batch.returns.double(), batch.response_mask.double(),
                         clip_range=trainer.config.critic.value_clip, agg="seq-mean-token-sum-norm", norm_len=16)
    loss.backward()
    want = {n: p.grad.detach().clone() for n, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)
    got, _, forwards = captured_update(trainer, critic, trainer.update_critic, batch)
    assert forwards > (1 if "critic.micro_batch_size=3" in split else 0)
    # the critic's value head computes in float32 whatever the backbone's dtype: the loss is float64, the
    # forward float32 (the old per-micro-batch normaliser was off by 10-90%)
    _assert_same({k: v.double() for k, v in got.items()}, {k: v.double() for k, v in want.items()}, 1e-4)


def test_token_budgets_count_the_observation_tokens_of_episodes(tmp_path):
    """actor.max_tokens_per_micro_batch bounds what a forward runs on: with multi-turn episodes that is the
    prompt and every attended response token, the environment's observations included."""
    from test_rl_multiturn import mt_config

    budget = 60
    trainer = RLTrainer(mt_config(tmp_path, f"actor.max_tokens_per_micro_batch={budget}",
                                  "actor.share_prompt_forward=false", "actor.micro_batch_size=16",
                                  "actor.skip_zero_advantage=false"))
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    batch = trainer.compute_advantages(trainer.compute_log_probs(batch))
    assert bool((batch.response_attention.sum(-1) > batch.response_mask.sum(-1)).any())  # observations
    shapes = []
    hook = trainer.model.model.layers[0].register_forward_hook(lambda m, args, out: shapes.append(args[0].shape[:2]))
    try:
        trainer.update_policy(batch)
    finally:
        hook.remove()
    assert len(shapes) > 1 and sum(rows for rows, _ in shapes) == len(batch)
    assert all(rows == 1 or rows * width <= budget for rows, width in shapes), shapes


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_update_metrics_do_not_depend_on_skipping_zero_advantage_rows(tmp_path, agg):
    """With actor.skip_zero_advantage the loss-type metrics (pg_loss, clipfrac) are those of the whole batch,
    the skipped rows counting with their true value 0, as without skipping; entropy and approx_kl (not 0 for
    a skipped row, and unknown without its forward) are the means over the rows that ran. Float64 references
    over the whole batch in one forward."""
    trainer = _trainer(tmp_path, f"actor.loss_agg={agg}", "actor.micro_batch_size=3", "rollout.max_logprob_drift=null")
    batch = _batch(trainer, equal_groups=(0, 2))
    width = batch.response_ids.shape[1]
    with torch.no_grad():
        logprobs, entropy = response_logprobs(trainer.model, batch.input_ids, batch.attention_mask,
                                              batch.position_ids, width, with_entropy=True)
    mask = batch.response_mask.double()
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batch.old_logprobs = (logprobs + 0.3 * noise) * mask  # off the policy: some ratios clip
    loss, stats = ppo_policy_loss(logprobs, batch.old_logprobs, batch.advantages.double(), mask, agg=agg,
                                  norm_len=10)
    ran = RLTrainer.contributing_sequences(batch)
    assert 0 < int(ran.sum()) < len(batch) and stats["clipfrac"] > 0
    want_entropy = float(aggregate_loss(entropy[ran], mask[ran], agg))
    want_kl = float(((batch.old_logprobs - logprobs) * mask)[ran].sum() / mask[ran].sum())

    _, skipping, _ = _update_grads(trainer, batch)
    trainer.config.actor.skip_zero_advantage = False
    _, plain, _ = _update_grads(trainer, batch)
    assert skipping["actor/skipped_frac"] == 0.5 and "actor/skipped_frac" not in plain
    # (clipfrac is a float32 share in ppo_policy_loss)
    for key, want, rel in (("actor/pg_loss", float(loss), 1e-9), ("actor/clipfrac", float(stats["clipfrac"]), 1e-6)):
        assert skipping[key] == pytest.approx(want, rel=rel, abs=1e-12), key
        assert plain[key] == pytest.approx(want, rel=rel, abs=1e-12), key
    assert plain["actor/entropy"] == pytest.approx(float(aggregate_loss(entropy, mask, agg)), rel=1e-9)
    assert plain["actor/approx_kl"] == pytest.approx(float(stats["approx_kl"]), rel=1e-9)
    assert skipping["actor/entropy"] == pytest.approx(want_entropy, rel=1e-9)
    assert skipping["actor/approx_kl"] == pytest.approx(want_kl, rel=1e-9)


def test_no_host_sync_between_forward_and_backward(tmp_path, monkeypatch):
    """The micro-batch loss keeps its metrics on the device (a host sync there stalls an accelerator on every
    micro-batch); the update converts them once, at the end."""
    trainer = _trainer(tmp_path, "actor.kl_loss_coef=0.1", "actor.entropy_coef=0.01",
                       "actor.rollout_correction.mode=token_tis", "actor.entropy_top_fraction=0.2")
    batch = _batch(trainer, equal_groups=())
    batch.ref_logprobs = torch.full(batch.response_mask.shape, -2.0, dtype=torch.float64)
    width = batch.response_ids.shape[1]

    def forward(mb):
        return response_logprobs(trainer.model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                 mb.response_ids.shape[1], with_entropy=True)

    micro_loss = update.policy_loss(trainer.config.actor, width, forward)
    syncs = []
    for name in ("__float__", "__bool__", "__int__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        # The loss's own (the model's forward has its own, and the log-prob function one check that the
        # labels are token ids of the vocabulary).
        def counting(t, *a, _real=real, _name=name, **k):
            caller = sys._getframe(1).f_code.co_filename
            if "/verl/" in caller and "/site-packages/" not in caller and not caller.endswith("logits.py"):
                syncs.append(f"{_name} in {caller}:{sys._getframe(1).f_lineno}")
            return _real(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    loss, metrics = micro_loss(batch)
    monkeypatch.undo()
    assert syncs == []
    assert {"actor/pg_loss", "actor/clipfrac", "actor/entropy", "actor/kl_loss", "rollout_corr/weight_mean",
            "rollout_corr/ratio_max", "actor/entropy_q10", "actor/entropy_q50", "actor/entropy_q90",
            "actor/entropy_top_frac"} <= set(metrics)
    assert all(torch.is_tensor(v) and not v.requires_grad for v in metrics.values()) and loss.requires_grad
