"""`actor.chunked_logprobs` for SFT and DPO: the target tokens' log-probs from the head's input in token chunks,
never a [tokens, V] logits tensor. In float64 the values and every parameter's gradient equal the plain logits
path within 1e-10 (unpacked and packed SFT rows, DPO pairs whole, in pair rows and on a cached prompt); one step
of each trainer is the same with and without; and no vocabulary-sized tensor beyond one chunk exists."""

from __future__ import annotations

import copy

import pytest
import torch
from rl_support import LargestVocabTensor
from test_dpo import ROWS as PAIRS
from test_dpo import make_config as dpo_config
from test_sft import ROWS as SFT_ROWS
from test_sft import make_config as sft_config
from tiny_support import load_tiny

import verl.algorithms.head_logprobs as head_mod
from verl.data.datasets import IGNORE_INDEX
from verl.trainer.forward import pair_rows
from verl.trainer.forward.logprobs import target_logprobs
from verl.trainer.offline import dpo_trainer
from verl.trainer.offline.dpo_trainer import DPOTrainer, shared_pair_layout, shared_sequence_logps
from verl.trainer.offline.sft_trainer import SFTTrainer, collate_sequences, shifted_targets

TOL = 1e-10
CPU = torch.device("cpu")


def _tiny(dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=dtype).train()


def _examples(vocab: int) -> list[tuple[list[int], list[int]]]:
    """(ids, shifted targets) of 4 examples of different lengths, the first few tokens of each a prompt."""
    g = torch.Generator().manual_seed(0)
    out = []
    for length, prompt in ((9, 3), (5, 2), (12, 6), (7, 1)):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append((ids, shifted_targets([IGNORE_INDEX] * prompt + ids[prompt:])))
    return out


def _pairs(vocab: int) -> list[dict[str, list[int]]]:
    """DPO items: a shared prompt, then a chosen and a rejected answer of different lengths."""
    g = torch.Generator().manual_seed(1)
    items = []
    for prompt_len, chosen_len, rejected_len in ((4, 3, 5), (2, 6, 2), (5, 2, 2)):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        item = {}
        for side, n in (("chosen", chosen_len), ("rejected", rejected_len)):
            ids = prompt + torch.randint(0, vocab, (n,), generator=g).tolist()
            item[f"{side}_input_ids"] = ids
            item[f"{side}_labels"] = [IGNORE_INDEX] * prompt_len + ids[prompt_len:]
        items.append(item)
    return items


def _values_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    values = fn()
    weights = torch.linspace(-1.0, 2.0, values.numel(), dtype=values.dtype)
    (values * weights).sum().backward()
    return values.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, fn):
    want_values, want = _values_and_grads(model, lambda: fn(False))
    got_values, got = _values_and_grads(model, lambda: fn(True))
    assert torch.allclose(got_values, want_values, rtol=0, atol=TOL)
    assert set(got) == set(want) and float(want["model.embed_tokens.weight"].abs().max()) > 0
    for name, g in want.items():
        assert torch.allclose(got[name], g, rtol=0, atol=TOL), (name, float((got[name] - g).abs().max()))


@pytest.mark.parametrize("packed", [False, True])
def test_sft_target_logprobs_equal_the_plain_path_in_float64(packed):
    model = _tiny()
    rows = [[e] for e in _examples(model.config.vocab_size)]
    if packed:
        rows = [rows[0] + rows[1], rows[2] + rows[3]]
    batch = collate_sequences(rows, model.config.pad_token_id, packed)
    _assert_same(model, lambda chunked: target_logprobs(model, batch, CPU, chunked)[0])


@pytest.mark.parametrize("shared", [None, "pair_rows", "cached"])
def test_dpo_sequence_logps_equal_the_plain_path_in_float64(shared, monkeypatch):
    model = _tiny()
    items = _pairs(model.config.vocab_size)
    pad = model.config.pad_token_id
    batch = collate_sequences([[(it[f"{side}_input_ids"], shifted_targets(it[f"{side}_labels"]))]
                               for side in ("chosen", "rejected") for it in items], pad, packed=False)

    def sums(chunked):
        logprobs, rows = target_logprobs(model, batch, CPU, chunked)
        return torch.zeros(2 * len(items), dtype=logprobs.dtype).index_add(0, rows, logprobs)

    if not shared:
        _assert_same(model, sums)
        return
    want_values, want = _values_and_grads(model, lambda: sums(False))  # the whole sequences (sdpa)
    if shared == "cached":  # a model that cannot take pair rows
        monkeypatch.setattr(dpo_trainer, "takes_masks", lambda model: False)
    layout = shared_pair_layout(items, pad)
    assert pair_rows.pair_rows_fit(layout) and dpo_trainer.takes_masks(model) == (shared != "cached")
    _assert_same(model, lambda chunked: shared_sequence_logps(model, layout, CPU, chunked))
    got_values, got = _values_and_grads(model, lambda: shared_sequence_logps(model, layout, CPU))
    assert torch.allclose(got_values, want_values, rtol=0, atol=TOL)
    # Hugging Face's RMS norms compute in float32 even in a float64 model, and their backward rounds each
    # position's gradient there: summed over other layouts of the same positions, the gradients agree to float32
    for name, g in want.items():
        assert float((got[name] - g).abs().max()) <= 1e-5 * float(g.abs().max()), name



def test_sft_holds_no_logits_beyond_one_chunk(monkeypatch):
    model = _tiny(torch.float32)
    vocab = model.config.vocab_size
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", vocab * 4)
    examples = _examples(vocab)
    batch = collate_sequences([[e] for e in examples], model.config.pad_token_id, packed=False)
    with LargestVocabTensor(vocab) as probe:
        logprobs, _ = target_logprobs(model, batch, CPU, chunked=True)
        logprobs.sum().backward()
    targets = sum(sum(t != IGNORE_INDEX for t in tgt) for _, tgt in examples)
    assert probe.rows <= max(4, len(examples)) < targets  # the model's own logits: one position per row


def _one_step(trainer):
    """A step's metrics and gradients (kept on the parameters until the next step; Adam's first step is
    about lr x sign(gradient), which rounding flips where a gradient is near 0)."""
    metrics = trainer.train_steps(1)[0]
    return metrics, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_trainer_step_is_the_same_with_and_without(kind):
    model, tok = load_tiny()
    runs = {}
    for chunked in (False, True):
        if kind == "sft":
            trainer = SFTTrainer(sft_config(actor={"chunked_logprobs": chunked}), model=copy.deepcopy(model),
                                 tokenizer=tok, train_rows=SFT_ROWS)
        else:
            trainer = DPOTrainer(dpo_config(actor={"chunked_logprobs": chunked}), model=copy.deepcopy(model),
                                 tokenizer=tok, train_rows=PAIRS)
            assert trainer.chunks_logprobs(trainer.ref_model) is chunked
        assert trainer.chunked_logprobs is chunked
        runs[chunked] = _one_step(trainer)
    (want, want_grads), (got, got_grads) = runs[False], runs[True]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and set(got_grads) == set(want_grads) and want_grads
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-12), name
