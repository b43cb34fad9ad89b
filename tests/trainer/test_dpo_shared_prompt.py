"""DPO with a shared-prompt forward: a pair's prompt runs once, and both answers either in the same row of one
forward (pair rows: each answer masked from the other) or on the prompt's cached keys/values (two forwards);
the log-prob sums and every parameter's gradient equal the concatenated forward's."""

from __future__ import annotations

import copy

import pytest
import torch
from test_dpo import ROWS, make_config

from verl.trainer.forward import pair_rows
from verl.trainer.forward.logprobs import can_share_prompt
from verl.trainer.offline import dpo_trainer
from verl.trainer.offline.dpo_trainer import DPOTrainer, PairBatch


def _trainer(tiny, share: bool, **actor):
    model, tok = tiny
    cfg = make_config(actor={"share_prompt_forward": share, **actor})
    return DPOTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok, train_rows=ROWS)


@pytest.mark.parametrize("layout,passes", [("pair_rows", 1), ("cached", 2)])
def test_shared_pair_logps_and_gradients_equal_the_concatenated_forward(tiny, monkeypatch, layout, passes):
    if layout == "cached":  # a model that cannot take pair rows: the cached forward
        monkeypatch.setattr(dpo_trainer, "takes_masks", lambda model: False)
    tr = _trainer(tiny, share=True)
    items = [tr.train_data[i] for i in range(6)]
    batch = tr.pair_batch(items)
    assert batch.share
    forwards = []
    hook = tr.model.register_forward_hook(lambda *a: forwards.append(1))

    def run(b):
        tr.model.zero_grad(set_to_none=True)
        logps = tr.sequence_logps(tr.model, b)
        (logps * torch.linspace(-1, 2, len(logps))).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in tr.model.named_parameters()}

    got_lp, got = run(batch)
    assert len(forwards) == passes  # pair rows: one forward; cached: prompts once, then both answers
    assert "collated" not in vars(batch)  # the concatenated layout was never built
    want_lp, want = run(PairBatch(items, tr.pad_id, share=False))
    hook.remove()
    assert got_lp.shape == (12,)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    for name, g in want.items():
        assert float((got[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-12), name


def test_dpo_steps_with_and_without_sharing_agree(tiny):
    shared, plain = _trainer(tiny, True, micro_batch_size=4), _trainer(tiny, False, micro_batch_size=4)
    a, b = shared.step(), plain.step()
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_pairs_without_a_common_prefix_and_one_token_answers(tiny):
    from verl.trainer.offline.dpo_trainer import shared_pair_layout

    tr = _trainer(tiny, share=True)
    IGN = -100
    items = [{"chosen_input_ids": [5, 6, 7], "chosen_labels": [IGN, 6, 7],
              "rejected_input_ids": [8, 9], "rejected_labels": [IGN, 9]},      # no common prefix
             {"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [IGN, IGN, IGN, 8],
              "rejected_input_ids": [5, 6, 7, 9], "rejected_labels": [IGN, IGN, IGN, 9]}]  # one-token answers
    layout = shared_pair_layout(items, 0)
    assert layout["prompt_ids"].tolist() == [[0, 0, 5], [5, 6, 7], [0, 0, 8], [5, 6, 7]]
    assert layout["targets"].tolist() == [[6, 7], [8, -100], [9, -100], [9, -100]]
    tr.model.zero_grad(set_to_none=True)
    got = tr.sequence_logps(tr.model, tr.pair_batch(items))
    want = tr.sequence_logps(tr.model, PairBatch(items, tr.pad_id, share=False))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pair_rows_only_where_the_model_takes_the_mask_as_given(tiny):
    """Pair rows need sdpa attention (which takes a prepared boolean 4-D mask as it is) and layers that all see the
    whole past: a property of the model, the same on every rank. Other models run the cached forward."""
    model = _trainer(tiny, share=True).model
    config = model.config
    assert pair_rows.takes_masks(model)
    for changes in ({"_attn_implementation": "flash_attention_2"}, {"_attn_implementation": "eager"},
                    {"sliding_window": 4, "use_sliding_window": True},
                    {"layer_types": ["sliding_attention"] * config.num_hidden_layers}):
        before = {key: getattr(model.config, key, None) for key in changes}
        for key, value in changes.items():
            setattr(model.config, key, value)
        try:
            assert not pair_rows.takes_masks(model), changes
        finally:
            for key, value in before.items():
                setattr(model.config, key, value)
    assert pair_rows.takes_masks(model)


def test_pairs_that_do_not_fit_pair_rows_run_whole_in_one_forward(tiny, monkeypatch):
    """A batch whose pairs do not fit pair rows (a pair without a common first token, too large a mask) runs the
    whole sequences: one forward, like pair rows, so that FSDP ranks whose batches differ run the same forwards."""
    from verl.trainer.offline.dpo_trainer import shared_pair_layout

    tr = _trainer(tiny, share=True)
    items = [tr.train_data[i] for i in range(4)]
    assert pair_rows.pair_rows_fit(shared_pair_layout(items, tr.pad_id))
    IGN = -100
    apart = items + [{"chosen_input_ids": [5, 6, 7], "chosen_labels": [IGN, 6, 7],
                      "rejected_input_ids": [8, 9], "rejected_labels": [IGN, 9]}]
    assert not pair_rows.pair_rows_fit(shared_pair_layout(apart, tr.pad_id))
    forwards = []
    hook = tr.model.register_forward_hook(lambda *a: forwards.append(1))
    for batch_items, limit in ((apart, pair_rows.MAX_MASK_ENTRIES), (items, 0)):
        monkeypatch.setattr(pair_rows, "MAX_MASK_ENTRIES", limit)
        forwards.clear()
        batch = tr.pair_batch(batch_items)
        got = tr.sequence_logps(tr.model, batch)
        assert len(forwards) == 1 and "collated" in vars(batch)
        want = tr.sequence_logps(tr.model, PairBatch(batch_items, tr.pad_id, share=False))
        torch.testing.assert_close(got, want)
    hook.remove()


def test_pair_rows_share_prompts_under_gradient_checkpointing(tiny):
    """Gradient checkpointing turns the cached forward off (its recomputation would append to the cache), not pair
    rows: one forward, recomputed in backward as it ran; the same sums and gradients as whole sequences."""
    tr = _trainer(tiny, share=True)
    tr.model.gradient_checkpointing_enable()
    tr.model.train()
    items = [tr.train_data[i] for i in range(6)]
    assert not can_share_prompt(tr.model)

    def run(batch):
        tr.model.zero_grad(set_to_none=True)
        logps = tr.sequence_logps(tr.model, batch)
        (logps * torch.linspace(-1, 2, len(logps))).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in tr.model.named_parameters()}

    batch = tr.pair_batch(items)
    got_lp, got = run(batch)
    assert "collated" not in vars(batch)  # pair rows ran
    want_lp, want = run(PairBatch(items, tr.pad_id, share=False))
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    for name, g in want.items():
        assert float((got[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-12), name
